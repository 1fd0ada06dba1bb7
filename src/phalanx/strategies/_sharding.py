from typing import final

from jax.sharding import Mesh
from jaxtyping import PyTree
from typing_extensions import override

from .._typing import Devices, validates_own_arguments
from ._mesh import make_mesh, shard_map_reduce
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

    @validates_own_arguments
    def __init__(self, devices: Devices = None):
        """Args:
        devices: None for all local devices, an int for the first n, or a
            sequence of devices.
        """
        self.axis_name = "data"
        self.mesh = make_mesh(devices, self.axis_name)
        self.microbatches = 1

    @override
    def reduce(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        return fn(replicated, carry, examples)

    @override
    def reduce_per_device(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        return shard_map_reduce(
            self.mesh, self.axis_name, fn, replicated, carry, examples
        )

    @override
    def map(self, fn: MapFn, replicated: PyTree, examples: PyTree) -> PyTree:
        return fn(replicated, examples)
