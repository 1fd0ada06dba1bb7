"""`PmapStrategy`: data parallelism as a per-device program with explicit
collectives, the state replicated on every device. Its mesh, batch split
and per-device program come from `DeviceMeshStrategy`; this module says
that every step runs per device, and checks the axis name users' code
passes to collectives."""

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
class PmapStrategy(DeviceMeshStrategy):
    """Data parallelism as a per-device program with explicit collectives.

    Each device runs the step on its slice of the batch inside `jax.shard_map`
    (the successor of `jax.pmap`), then one `psum` adds up gradients, loss and
    metrics. User code inside the loss may call `jax.lax.psum`,
    `jax.lax.all_gather`, ... with `axis_name`. State stays ordinary
    replicated arrays, interchangeable with [`phalanx.ShardingStrategy`][].

    BatchNorm with ``axis_name="batch"`` normalises over each device's slice;
    use ``axis_name=("batch", strategy.axis_name)`` for global statistics.

    Example:
        ```python
        strategy = px.PmapStrategy(devices=8, axis_name="data")
        ```
    """

    mesh: Mesh
    axis_name: AxisName  # one name here: the 1-D mesh's axis
    # Whether the one cross-device reduction adds in a fixed device order.
    deterministic: bool

    @validates_own_arguments
    def __init__(
        self,
        devices: Devices = None,
        axis_name: str = "data",
        *,
        deterministic: bool = False,
    ):
        """
        Args:
            devices: None for all local devices (every process's in a
                multi-process run), an int for the first n, or a sequence of
                devices.
            axis_name: the name collectives use for the device axis.
            deterministic: sum the devices' gradients in a fixed order (an
                all-gather, then additions in device order) instead of an
                all-reduce: bitwise the same result however the devices are
                spread over processes, for debugging and reproducibility; costs
                memory and time in proportion to the device count.
        """
        if not isinstance(axis_name, str) or not axis_name or axis_name == "batch":
            raise ValueError(
                f"axis_name={axis_name!r} must be a non-empty string other than "
                "'batch' (the per-example vmap axis); e.g. axis_name='data'"
            )
        self.axis_name = axis_name
        self.mesh = make_mesh(devices, axis_name)
        self.deterministic = boolean("deterministic", deterministic)

    @override
    def state_spec(self, role: StateRole, leaf: jax.ShapeDtypeStruct) -> P:
        del role, leaf
        return P()  # a full replica on every device

    @override
    def reduce(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        return self.reduce_per_device(fn, replicated, carry, examples)

    @override
    def map(self, fn: MapFn, replicated: PyTree, examples: PyTree) -> PyTree:
        return self.map_per_device(fn, replicated, examples)
