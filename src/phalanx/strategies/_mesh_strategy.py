"""`MeshStrategy`: training on a mesh of named axes ``("data", "fsdp",
"context", "tensor")``: data parallelism, fully sharded (and hybrid) data
parallelism, sequences split over devices and tensor parallelism by sharding
rules, in one global `jax.jit` program.

The batch is split over ``data`` × ``fsdp``, and each example's sequence
over ``context`` (`_sequences.py`; attention exchanges the positions,
`phalanx.models.dot_product_attention`). The parameters and optimizer
state are split over ``fsdp`` by size (as `FullyShardedStrategy` splits
them) and over any axis as the rules say (`_rules.py`); the compiler adds
the collectives (an all-gather where a split parameter is used, a reduction
of each gradient into its optimizer state's layout).
"""

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, final

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding
from jaxtyping import PyTree
from typing_extensions import override

from .._contracts import SequenceSplit
from .._typing import Devices, validates_own_arguments
from .._validate import is_int
from ._axes import MESH_AXES
from ._device_mesh import DeviceMeshStrategy, StateRole, make_mesh
from ._example_sums import examples_summed_by_dots
from ._mesh_layout import MeshLayout
from ._per_device import shard_map_reduce
from ._placement import has_host_memory, named
from ._rules import CheckedRule, Rule, check_rules
from ._sequences import (
    SequenceDims,
    check_sequence_dims,
    check_within_processes,
    sequence_specs,
    traced_with_split,
)
from ._strategy import AxisName, ExampleShapes, LocalFn, MapFn, MeshSettings


@final
class MeshStrategy(DeviceMeshStrategy):
    """Data, fully sharded, sequence and tensor parallelism on one mesh of
    named axes ``("data", "fsdp", "context", "tensor")``, in the global view
    of `jax.jit`.

    - **Batch**: split over ``data`` × ``fsdp`` (each position along them
      gets an equal slice), whole along ``tensor``; with ``context > 1``
      each example's sequence dimension (`sequence_dims` says which, per
      batch leaf) split over ``context``, other leaves whole along it.
    - **State over ``context``**: replicated (unless a rule names it); the
      gradients are summed over it as over the batch axes.
    - **State over ``data``**: replicated.
    - **State over ``fsdp``**: each floating leaf of at least `min_size`
      elements split along its longest dimension that the axis divides (the
      rule of `FullyShardedStrategy`; never the layer axis of a
      [`Stacked`][phalanx.models.Stacked] array, so that each layer is
      gathered on its turn), unless a rule says otherwise.
    - **State over ``tensor``**: only what `rules` says.
    - **`rules`**: ``(pattern, spec)`` pairs. `pattern` is a regular
      expression `re.fullmatch`ed against a parameter's path in the model
      (``jax.tree_util.keystr(path, simple=True, separator=".")``, e.g.
      ``"blocks.layers.0.weight"``); `spec` has an entry per dimension of the
      leaf: an axis name, a tuple of axis names, or None (whole). The first
      matching rule is the leaf's whole layout (name ``"fsdp"`` in it where
      the leaf should be split over that axis too). The optimizer state
      follows its parameters wherever it holds a tree of their shape
      (adam's moments, each group's under several optimizers, an EMA).
    - **With ``tensor > 1``** the step computes with each parameter
      gathered over ``data`` and ``fsdp`` (a stacked layer on its turn),
      and a grouped convolution's weight gradient as a dot product: two
      XLA partitioner bugs (see `use_shardings`, and the meshes guide).

    ``data=1, fsdp=N`` is FSDP; ``data=H, fsdp=N/H`` is hybrid sharding
    (replicated across hosts, split within each); ``tensor=T`` with rules is
    Megatron-style tensor parallelism; ``context=C`` splits long sequences
    (each device holds 1/C of every example's positions and activations:
    the model's attention must be
    [`phalanx.models.dot_product_attention`][], which exchanges them; see
    the long sequences guide). Devices fill the mesh in order, the
    last axis varying fastest: with one process per host, consecutive
    devices are a host's, so ``tensor`` and then ``fsdp`` stay within a host
    and ``data`` goes across hosts.

    The step is one program in the global view: the compiler places the
    collectives. The strategy also has a per-device program
    (`reduce_per_device`, each device its slice in `jax.shard_map` over the
    batch axes, one reduction after): [`phalanx.AccumulatingStrategy`][]
    wraps it to reduce once per update, and under a mixed `precision`
    policy the gradients cross devices there, in the policy's `reduce`
    dtype, as under the 1-D strategies.

    Example:
        ```python
        strategy = px.MeshStrategy(data=2, fsdp=4)  # hybrid sharding on 8
        # Megatron-style MLP blocks `up` then `down`, in a field `blocks`
        # that is a px.models.Stacked: each array's layer axis comes first,
        # whole (unrolled in a list, the paths are blocks.0.up.weight, ...,
        # of shape (out, in): one entry fewer).
        strategy = px.MeshStrategy(
            data=2, fsdp=2, tensor=2,
            rules=[
                (r"blocks\\.layers\\.up\\.weight", (None, "tensor", "fsdp")),
                (r"blocks\\.layers\\.down\\.weight", (None, "fsdp", "tensor")),
            ],
        )
        ```
    """

    mesh: Mesh
    axis_name: AxisName  # ("data", "fsdp"): the axes a batch is split over
    # One global program: the compiler chooses how the sums cross devices.
    # (A ClassVar may stand for an `eqx.AbstractVar`; pyright cannot tell.)
    deterministic: ClassVar[bool] = False  # pyright: ignore[reportIncompatibleVariableOverride]
    rules: tuple[CheckedRule, ...]
    # Leaves with fewer elements stay replicated over fsdp (splitting them
    # saves less than their collectives cost).
    min_size: int
    # The optimizer state kept in host memory, brought in for each update.
    offload: bool
    # Which dimension of which batch leaf `context` splits.
    sequence_dims: SequenceDims

    @validates_own_arguments
    def __init__(
        self,
        devices: Devices = None,
        *,
        data: int = -1,
        fsdp: int = 1,
        tensor: int = 1,
        context: int = 1,
        sequence_dims: Mapping[str, int] | int | None = None,
        rules: Sequence[Rule] = (),
        min_size: int = 2**12,
        offload: bool = False,
    ):
        """
        Args:
            devices: None for all local devices (every process's in a
                multi-process run), an int for the first n, or a sequence of
                devices.
            data: the size of the ``data`` axis (the batch split, the state
                replicated); -1: what the other axes leave of the devices.
            fsdp: the size of the ``fsdp`` axis (the batch and the state
                split); the sizes multiply to the device count, one of them
                may be -1.
            tensor: the size of the ``tensor`` axis (the state split where
                `rules` say, the batch whole).
            context: the size of the ``context`` axis: each example's
                sequence dimension split over it (the state replicated).
            sequence_dims: which dimension of which batch leaf is its
                sequence: ``{pattern: dim}``, each pattern a regular
                expression fullmatched against a leaf's name in ``(x, y)``
                (``"x"``, ``"y"``, ``"x.tokens"``, ``"x.1"``), `dim` a
                dimension of the batch array (1: the first after the
                examples axis); or one int, that dimension of every leaf
                that has it. Leaves it does not name are whole along
                ``context``. Required with ``context > 1``; each sequence's
                length must be a multiple of `context` (pad with a mask).
            rules: ``(pattern, spec)`` pairs saying where parameters are
                split (see above).
            min_size: leaves with fewer elements stay replicated over fsdp
                (a rule still splits them).
            offload: keep the optimizer state in host memory (the devices'
                ``pinned_host``), laid out as on the devices, and bring it
                to them for each update: less device memory between steps,
                the state's bytes across the host link twice a step.

        Raises:
            ValueError: a size is not an int >= 1 or -1, the sizes do not
                multiply to the device count, a rule names an unknown axis
                or is not a regular expression, ``context > 1`` without
                `sequence_dims`.
            TypeError: `rules` is not a sequence of (pattern, spec) pairs,
                `sequence_dims` not a mapping or an int.
        """
        sizes = {"data": data, "fsdp": fsdp, "context": context, "tensor": tensor}
        for name, size in sizes.items():
            if not is_int(size) or (size < 1 and size != -1):
                raise ValueError(
                    f"{name}={size!r} must be an int >= 1, or -1 for what the "
                    f"other axes leave of the devices; e.g. {name}=2"
                )
        if not is_int(min_size) or min_size < 1:
            raise ValueError(
                f"min_size={min_size!r} must be an int >= 1 (leaves with fewer "
                "elements stay replicated), e.g. min_size=4096"
            )
        self.rules = check_rules(rules, MESH_AXES)
        self.sequence_dims = check_sequence_dims(sequence_dims)
        self.axis_name = ("data", "fsdp")
        self.mesh = make_mesh(devices, sizes)  # first: sizes that do not fit
        if context != 1 and not self.sequence_dims:
            raise ValueError(
                f"context={context} splits each example's sequence over devices: "
                "say which dimension of which batch leaf is a sequence, e.g. "
                'sequence_dims={"x": 1, "y": 1} (tokens and next tokens of '
                "shape (examples, sequence)), or sequence_dims=1"
            )
        check_within_processes(self.mesh)
        self.min_size = min_size
        first = self.mesh.devices.flat[0]
        if offload and not has_host_memory(first):
            raise ValueError(
                f"offload=True keeps the optimizer state in host memory, which "
                f"the {first.platform} devices do not offer to JAX (no "
                "'pinned_host' memory kind); pass offload=False"
            )
        self.offload = bool(offload)

    @override
    def split_min_size(self) -> int:
        return self.min_size

    @override
    def mesh_settings(self) -> MeshSettings:
        dims = self.sequence_dims
        return MeshSettings(
            rules=tuple((rule.pattern, rule.spec) for rule in self.rules),
            min_size=self.min_size,
            context=self.mesh.shape["context"],
            sequence_dims=dims.every if dims.every is not None else dict(dims.pairs),
            offload=self.offload,
        )

    @override
    def batch_leaf_shardings(
        self, names: Sequence[str], shapes: ExampleShapes, *, whole: bool = True
    ) -> list[Sharding]:
        """`batch_sharding` for each leaf, with the sequence dimension that
        `sequence_dims` names for it split over ``context`` too.

        Raises:
            ValueError: a `sequence_dims` pattern matches no leaf (of a
                `whole` batch), names a dimension past a leaf's last, or
                ``context`` does not divide a sequence's length.
        """
        dims, mesh = self.sequence_dims, self.mesh
        specs = sequence_specs(dims, names, shapes, self.batch_axes, mesh, whole)
        return [named(mesh, spec) for spec in specs]

    @override
    def state_spec(self, role: StateRole, leaf: jax.ShapeDtypeStruct) -> P:
        """The fsdp rule by size, for an array whose path is not known."""
        del role
        return self._layout().by_size(tuple(leaf.shape))

    @override
    def state_shardings(self, state: PyTree[Any]) -> PyTree[NamedSharding]:
        """The model's floating arrays by the rules, then by size; the
        optimizer state's as their parameters (by size where it holds an
        array of no parameter's shape); everything else whole.

        Raises:
            ValueError: a rule does not fit a leaf it matches (its number of
                entries, or an axis size that does not divide), or matches
                no leaf.
        """
        return self._layout().state_shardings(state)

    @override
    def gradient_shardings(self, params: PyTree[Any]) -> PyTree[NamedSharding]:
        """Each gradient where its parameter is: left to itself, the
        compiler may keep a small whole parameter's gradient split."""
        return params

    @override
    def use_shardings(self, params: PyTree[Any]) -> PyTree[NamedSharding] | None:
        """With ``tensor > 1``: each parameter as it is split over
        ``tensor``, gathered whole over the batch axes (as fully sharded
        data parallelism gathers a layer before using it).

        Why: XLA's SPMD partitioner (jaxlib 0.10.2) can compute a wrong
        gradient when a parameter split over ``fsdp`` (an axis the batch is
        split over) is used together with activations split over
        ``tensor``: resharding the batch it exchanges the ``data`` and
        ``fsdp`` blocks between devices and does not exchange them back
        (``tests/strategies/test_xla_partitioner.py``). Computing with the
        parameters gathered over the batch axes leaves it the data- and
        tensor-parallel layouts it partitions right. (A `Stacked` model's
        layers are still gathered one at a time, inside their loop.)
        """
        if self.mesh.shape["tensor"] == 1:
            return None
        return self._layout().gathered_over(params, self.batch_axes)

    @override
    def reduce(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        """`fn` on the whole batch, in the global view. With the batch
        replicated over ``tensor``, a convolution summing over the examples
        (a grouped convolution's weight gradient) is computed as a dot
        product: XLA would count its partial sums once per ``tensor``
        device (`_example_sums.py`)."""
        if self.mesh.shape["tensor"] > 1:
            fn = examples_summed_by_dots(fn)
        return self._splitting(fn, self.batch_axes)(replicated, carry, examples)

    @override
    def map(self, fn: MapFn, replicated: PyTree, examples: PyTree) -> PyTree:
        return self._splitting(fn, self.batch_axes)(replicated, examples)

    @override
    def reduce_per_device(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        """`fn` on each device's slice, in `jax.shard_map` manual over the
        batch axes (``data`` and ``fsdp``; ``context`` and ``tensor`` stay
        automatic, so the compiler still splits the work over them: the
        sequence as the batch lies, the parameters as the rules say).

        Each parameter enters gathered whole over the batch axes (the
        compiler gathers it from wherever the rules put it, once, before
        `fn`), and the devices' sums leave in one all-reduce over the batch
        axes; the step then lays each gradient out as its parameter (a
        slice of the sum: no further collective). Under
        `AccumulatingStrategy` that is one reduction per update, however
        many microbatches `fn` scans: the per-device contract held truly,
        not the global program under its name. (A split gradient is summed
        whole, not reduce-scattered: the rules' layout is by path, which
        the sums' tree does not carry. XLA:CPU lowers the global program's
        reduction of a split gradient to an all-reduce and a slice too.)
        With ``tensor > 1`` grouped convolutions' weight gradients are
        computed as dot products, as in `reduce`.
        """
        if self.mesh.shape["tensor"] > 1:
            fn = examples_summed_by_dots(fn)
        fn = self._splitting(fn, ())
        return shard_map_reduce(
            self.mesh, self.batch_axes, fn, replicated, carry, examples
        )

    def _splitting(self, fn: Any, batch_axes: tuple[str, ...]) -> Any:
        """`fn`, traced knowing each sequence is split over ``context``
        (`phalanx.models.dot_product_attention` asks), where it is; the
        examples split over `batch_axes` where `fn` runs (none inside a
        per-device program)."""
        if self.mesh.shape["context"] == 1:
            return fn
        return traced_with_split(fn, SequenceSplit(self.mesh, "context", batch_axes))

    def _layout(self) -> MeshLayout:
        return MeshLayout(self.mesh, tuple(self.rules), self.min_size, self.offload)
