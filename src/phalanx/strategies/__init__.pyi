"""The public names of `phalanx.strategies`, imported on first use (see
__init__.py)."""

from ._accumulating import AccumulatingStrategy as AccumulatingStrategy
from ._build import sharded_model as sharded_model
from ._device_mesh import DeviceMeshStrategy as DeviceMeshStrategy
from ._fully_sharded import FullyShardedStrategy as FullyShardedStrategy
from ._mesh_strategy import MeshStrategy as MeshStrategy
from ._pmap import PmapStrategy as PmapStrategy
from ._sharding import ShardingStrategy as ShardingStrategy
from ._strategy import (
    MeshSettings as MeshSettings,
    PerDeviceStrategy as PerDeviceStrategy,
    Strategy as Strategy,
)
