from typing import final

from jax.sharding import Mesh
from jaxtyping import PyTree
from typing_extensions import override

from .._typing import Devices, validates_own_arguments
from ._mesh import check_deterministic, make_mesh, shard_map_reduce
from ._strategy import LocalFn, MapFn, Strategy


@final
class ShardingStrategy(Strategy):
    """Data parallelism in the global view: `jax.jit` over sharded arrays.

    The step is written as if on one device over the whole batch; the batch is
    split along a 1-D ``"data"`` mesh with `NamedSharding` and the compiler
    inserts the one gradient all-reduce. BatchNorm statistics computed with
    ``axis_name="batch"`` are therefore over the global batch.

    Example:
        ```python
        strategy = px.ShardingStrategy()          # all local devices
        strategy = px.ShardingStrategy(devices=4)  # the first four
        ```
    """

    mesh: Mesh
    axis_name: str
    microbatches: int
    deterministic: bool

    @validates_own_arguments
    def __init__(self, devices: Devices = None, *, deterministic: bool = False):
        """Args:
        devices: None for all local devices (every process's in a
            multi-process run), an int for the first n, or a sequence of
            devices.
        deterministic: sum the devices' gradients in a fixed order (an
            all-gather, then additions in device order) instead of an
            all-reduce: bitwise the same result however the devices are
            spread over processes, for debugging and reproducibility; costs
            memory and time in proportion to the device count.
        """
        self.axis_name = "data"
        self.mesh = make_mesh(devices, self.axis_name)
        self.microbatches = 1
        self.deterministic = check_deterministic(deterministic)

    @override
    def reduce(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        if self.deterministic:  # explicit per-device sums, added in order
            return self.reduce_per_device(fn, replicated, carry, examples)
        return fn(replicated, carry, examples)

    @override
    def reduce_per_device(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        return shard_map_reduce(
            self.mesh,
            self.axis_name,
            fn,
            replicated,
            carry,
            examples,
            deterministic=self.deterministic,
        )

    @override
    def map(self, fn: MapFn, replicated: PyTree, examples: PyTree) -> PyTree:
        return fn(replicated, examples)
