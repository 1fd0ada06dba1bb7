"""How a training step runs across devices: the strategy contract, the mesh
strategy base, the built-in strategies, and models built in their shards
(re-exports only)."""

from ._accumulating import AccumulatingStrategy as AccumulatingStrategy
from ._build import sharded_model as sharded_model
from ._device_mesh import DeviceMeshStrategy as DeviceMeshStrategy
from ._fully_sharded import FullyShardedStrategy as FullyShardedStrategy
from ._mesh_strategy import MeshStrategy as MeshStrategy
from ._pmap import PmapStrategy as PmapStrategy
from ._sharding import ShardingStrategy as ShardingStrategy
from ._strategy import PerDeviceStrategy as PerDeviceStrategy, Strategy as Strategy
