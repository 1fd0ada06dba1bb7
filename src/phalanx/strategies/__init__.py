from ._accumulating import AccumulatingStrategy as AccumulatingStrategy
from ._fully_sharded import FullyShardedStrategy as FullyShardedStrategy
from ._pmap import PmapStrategy as PmapStrategy
from ._sharding import ShardingStrategy as ShardingStrategy
from ._strategy import PerDeviceStrategy as PerDeviceStrategy, Strategy as Strategy
