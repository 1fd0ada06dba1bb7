"""`ShardingStrategy`: data parallelism in the global view of `jax.jit`, the
state replicated on every device. Its mesh, batch split and per-device
program come from `DeviceMeshStrategy`; this module says only that the
step is one global program, which the compiler splits."""

from typing import final

import jax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import PyTree
from typing_extensions import override

from .._typing import Devices, validates_own_arguments
from .._validate import boolean
from ._device_mesh import DeviceMeshStrategy, StateRole, make_mesh
from ._strategy import AxisName, LocalFn, MapFn


@final
class ShardingStrategy(DeviceMeshStrategy):
    """Data parallelism in the global view: `jax.jit` over sharded arrays.

    The step is written as if on one device over the whole batch; the batch is
    split along a 1-D ``"data"`` mesh with `NamedSharding` and the compiler
    inserts the one gradient all-reduce. State is replicated on every device.
    BatchNorm statistics computed with ``axis_name="batch"`` are therefore
    over the global batch.

    Example:
        ```python
        strategy = px.ShardingStrategy()          # all local devices
        strategy = px.ShardingStrategy(devices=4)  # the first four
        ```
    """

    mesh: Mesh
    axis_name: AxisName  # one name here: the 1-D mesh's axis
    # Whether the one cross-device reduction adds in a fixed device order.
    deterministic: bool

    @validates_own_arguments
    def __init__(self, devices: Devices = None, *, deterministic: bool = False):
        """
        Args:
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
        self.deterministic = boolean("deterministic", deterministic)

    @override
    def reduce(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        if self.deterministic:  # explicit per-device sums, added in order
            return self.reduce_per_device(fn, replicated, carry, examples)
        return fn(replicated, carry, examples)

    @override
    def map(self, fn: MapFn, replicated: PyTree, examples: PyTree) -> PyTree:
        return fn(replicated, examples)

    @override
    def state_spec(self, role: StateRole, leaf: jax.ShapeDtypeStruct) -> P:
        del role, leaf
        return P()  # every array whole on every device: nothing to gather
