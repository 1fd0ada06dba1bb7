from typing import final

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import PyTree
from typing_extensions import override

from .._typing import validates_own_arguments
from ._strategy import LocalFn, MapFn, Strategy


@final
class AccumulatingStrategy(Strategy):
    """Gradient accumulation around any strategy, exact by construction.

    Each device splits its slice of the batch into `microbatches` equal parts
    and adds up their sums (weighted loss, gradients, metrics) in a local
    `jax.lax.scan`; the inner strategy then reduces across devices once per
    update (NOTES trap 3: an accumulation written in the global view would
    all-reduce once per microbatch). Because sums are divided once by the
    global weight, the update equals one step on the whole batch, padding and
    ragged batches included. Model state (BatchNorm averages) is threaded
    through the microbatches in order.

    Example:
        ```python
        strategy = px.AccumulatingStrategy(px.PmapStrategy(), microbatches=4)
        ```
    """

    inner: Strategy
    microbatches: int
    mesh: Mesh
    axis_name: str
    deterministic: bool

    @validates_own_arguments
    def __init__(self, inner: Strategy, microbatches: int):
        """Args:
        inner: the strategy that places arrays and reduces across devices.
        microbatches: how many parts each device's slice is split into.
        """
        if not isinstance(inner, Strategy):
            raise TypeError(
                f"inner={inner!r} is not a phalanx Strategy; wrap one, e.g. "
                "AccumulatingStrategy(px.ShardingStrategy(), microbatches=4)"
            )
        if isinstance(inner, AccumulatingStrategy):
            raise TypeError(
                "inner is already an AccumulatingStrategy; wrap its inner strategy "
                "with the product of both microbatch counts instead: "
                f"AccumulatingStrategy(inner.inner, microbatches={inner.microbatches}"
                " * k)"
            )
        if isinstance(microbatches, bool) or not isinstance(microbatches, int):
            raise TypeError(f"microbatches={microbatches!r} must be an int, e.g. 4")
        if microbatches < 1:
            raise ValueError(
                f"microbatches={microbatches} must be >= 1 (1 means no "
                "accumulation); e.g. microbatches=4"
            )
        self.inner = inner
        self.microbatches = microbatches
        self.mesh = inner.mesh
        self.axis_name = inner.axis_name
        self.deterministic = inner.deterministic

    @override
    def reduce(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        return self.reduce_per_device(fn, replicated, carry, examples)

    @override
    def reduce_per_device(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        return self.inner.reduce_per_device(
            self._accumulate(fn), replicated, carry, examples
        )

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
