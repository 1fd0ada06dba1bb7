"""`AccumulatingStrategy`: gradient accumulation as a wrapper around any
strategy that declares a per-device program (`Strategy.per_device_reduce`).
The wrapper delegates the mesh, the layout and the one reduction to the
strategy it holds; it only scans each device's microbatches, so the
microbatches' gradients add up on each device and cross devices once."""

from collections.abc import Sequence
from typing import Any, final

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, Sharding
from jaxtyping import PyTree
from typing_extensions import override

from .._typing import validates_own_arguments
from .._validate import is_int
from ._strategy import (
    AxisName,
    ExampleShapes,
    LocalFn,
    MapFn,
    MeshSettings,
    Reduce,
    Strategy,
)


@final
class AccumulatingStrategy(Strategy):
    """Gradient accumulation around any strategy, exact by construction.

    Each device splits its slice of the batch into `microbatches` equal parts
    and adds up their sums (weighted loss, gradients, metrics) in a local
    `jax.lax.scan`; the inner strategy then reduces across devices once per
    update (an accumulation written in the global view, under `jax.jit`'s
    automatic sharding, would all-reduce once per microbatch). Because sums
    are divided once by the global weight, the update equals one step on the
    whole batch, padding and ragged batches included. Model state (BatchNorm
    averages) is threaded through the microbatches in order. Everything else
    (the mesh, the state's layout, collectives' axis name) is the inner
    strategy's.

    Example:
        ```python
        strategy = px.AccumulatingStrategy(px.PmapStrategy(), microbatches=4)
        ```
    """

    inner: Strategy
    microbatches: int

    @validates_own_arguments
    def __init__(self, inner: Strategy, microbatches: int):
        """
        Args:
            inner: the strategy that places arrays and reduces across
                devices; it must declare a per-device program
                (`per_device_reduce`), as every built-in strategy does.
            microbatches: how many parts each device's slice is split into.

        Raises:
            TypeError: `inner` is an `AccumulatingStrategy`, or declares no
                per-device program; `microbatches` is not an int.
            ValueError: `microbatches` < 1.
        """
        if isinstance(inner, AccumulatingStrategy):
            raise TypeError(
                "inner is already an AccumulatingStrategy; wrap its inner strategy "
                "with the product of both microbatch counts instead: "
                f"AccumulatingStrategy(inner.inner, microbatches={inner.microbatches}"
                " * k)"
            )
        if not isinstance(inner, Strategy) or inner.per_device_reduce() is None:
            raise TypeError(
                f"inner={inner!r} is not a phalanx strategy that runs per device "
                "(its per_device_reduce() is None: a global program would "
                "reduce once per microbatch); wrap one that does, e.g. "
                "AccumulatingStrategy(px.ShardingStrategy(), microbatches=4)"
            )
        if not is_int(microbatches):
            raise TypeError(f"microbatches={microbatches!r} must be an int, e.g. 4")
        if microbatches < 1:
            raise ValueError(
                f"microbatches={microbatches} must be >= 1 (1 means no "
                "accumulation); e.g. microbatches=4"
            )
        self.inner = inner
        self.microbatches = microbatches

    @property
    def mesh(self) -> Mesh:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.inner.mesh

    @property
    def axis_name(self) -> AxisName:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.inner.axis_name

    @property
    @override
    def num_devices(self) -> int:
        return self.inner.num_devices

    @override
    def split_min_size(self) -> int | None:
        return self.inner.split_min_size()

    @override
    def mesh_settings(self) -> MeshSettings | None:
        return self.inner.mesh_settings()

    @property
    @override
    def batch_sharding(self) -> Sharding:
        return self.inner.batch_sharding

    @override
    def batch_leaf_shardings(
        self, names: Sequence[str], shapes: ExampleShapes, *, whole: bool = True
    ) -> list[Sharding]:
        return self.inner.batch_leaf_shardings(names, shapes, whole=whole)

    @property
    @override
    def batch_multiple(self) -> int:
        return self.inner.batch_multiple * self.microbatches

    @override
    def state_shardings(self, state: PyTree[Any]) -> PyTree[Sharding]:
        return self.inner.state_shardings(state)

    @override
    def gradient_shardings(self, params: PyTree[Any]) -> PyTree[Sharding] | None:
        return self.inner.gradient_shardings(params)

    @override
    def use_shardings(self, params: PyTree[Any]) -> None:
        """None: the inner strategy's per-device program gathers each
        parameter whole over the batch axes before the microbatches."""
        del params
        return None

    @override
    def reduce(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        """Each device scans its microbatches, adding their sums; the inner
        strategy's per-device program then reduces the devices' totals once."""
        reduce = self.inner.per_device_reduce()
        assert reduce is not None, "checked when built"
        return reduce(self._accumulate(fn), replicated, carry, examples)

    @override
    def per_device_reduce(self) -> Reduce:
        """`reduce`: it already runs per device."""
        return self.reduce

    @override
    def map(self, fn: MapFn, replicated: PyTree, examples: PyTree) -> PyTree:
        return self.inner.map(fn, replicated, examples)

    def _accumulate(self, fn: LocalFn) -> LocalFn:
        """`fn` over one device's slice as a scan over its microbatches."""
        k = self.microbatches

        def accumulated(replicated, carry, examples):
            micro = jax.tree.map(
                lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), examples
            )
            first = jax.tree.map(lambda x: x[0], micro)
            shapes = jax.eval_shape(fn, replicated, carry, first)[0]
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

            def body(state, microbatch):
                total, carry = state
                sums, carry = fn(replicated, carry, microbatch)
                return (jax.tree.map(jnp.add, total, sums), carry), None

            (total, carry), _ = jax.lax.scan(body, (zeros, carry), micro)
            return total, carry

        return accumulated
