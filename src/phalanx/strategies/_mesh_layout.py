"""Where `MeshStrategy` puts the training state: the model's floating
arrays by the sharding rules, then over ``fsdp`` by size (never a stacked
array's layer axis); the optimizer state as its parameters; the rest whole
on every device, the optimizer state in host memory where offloaded. And
where a step computes with the parameters, where that differs (gathered
over the batch axes: `MeshStrategy.use_shardings`)."""

from collections.abc import Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from ._follow import follow_parameters
from ._fully_sharded import split_by_size
from ._mesh_leaves import floating, is_spec, stacked_leaves, trainable, warn_whole
from ._per_device import spec_axes
from ._placement import HOST_MEMORY, named
from ._rules import CheckedRule, RuleBook, path_name


class MeshLayout(NamedTuple):
    """A `MeshStrategy`'s mesh, checked rules, ``min_size`` and ``offload``:
    what decides where each leaf of the state lies."""

    mesh: Mesh
    rules: tuple[CheckedRule, ...]
    min_size: int
    offload: bool

    def state_shardings(self, state: PyTree[Any]) -> PyTree[NamedSharding]:
        """See `MeshStrategy.state_shardings`."""
        book = RuleBook(self.rules, dict(self.mesh.shape))
        stacked = stacked_leaves(state.model)
        model_specs = jax.tree_util.tree_map_with_path(
            lambda path, leaf: self._model_spec(
                book, path_name(path), leaf, id(leaf) in stacked
            ),
            state.model,
        )
        book.check_all_used()
        warn_whole(self.mesh, self.min_size, state.model, model_specs)
        opt_specs = follow_parameters(
            state.model, model_specs, state.opt_state, trainable, self._leaf_spec
        )
        whole = named(self.mesh, P())

        def place(specs: PyTree[P], memory: str | None = None) -> PyTree[NamedSharding]:
            return jax.tree.map(
                lambda s: named(self.mesh, s, memory), specs, is_leaf=is_spec
            )

        return eqx.tree_at(
            lambda s: (s.model, s.opt_state),
            jax.tree.map(lambda _: whole, state),
            (
                place(model_specs),
                place(opt_specs, HOST_MEMORY if self.offload else None),
            ),
        )

    def gathered_over(
        self, params: PyTree[NamedSharding], axes: Sequence[str]
    ) -> PyTree[NamedSharding]:
        """Each parameter's sharding (`params`: the model with each one in
        place of its array) whole over `axes`, split as before over the
        others (see `MeshStrategy.use_shardings`)."""
        gathered = set(axes)

        def whole_over(sharding: NamedSharding) -> NamedSharding:
            entries = [
                tuple(axis for axis in spec_axes(entry) if axis not in gathered)
                for entry in sharding.spec
            ]
            return named(
                self.mesh, P(*[e[0] if len(e) == 1 else (e or None) for e in entries])
            )

        return jax.tree.map(whole_over, params)

    def by_size(self, shape: tuple[int, ...], keep_first: bool = False) -> P:
        """The fsdp rule (never the layer axis of a stacked array)."""
        n = self.mesh.shape["fsdp"]
        return split_by_size(shape, "fsdp", n, self.min_size, keep_first=keep_first)

    def _model_spec(
        self, book: RuleBook, path: str, leaf: Any, stacked: bool = False
    ) -> P:
        if not floating(leaf):
            return P()
        spec = book.spec(path, tuple(leaf.shape), stacked)
        if spec is not None:
            return spec
        return self.by_size(tuple(leaf.shape), keep_first=stacked)

    def _leaf_spec(self, leaf: Any) -> P:
        return self.by_size(tuple(leaf.shape)) if floating(leaf) else P()
