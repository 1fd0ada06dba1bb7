from ._accumulating import AccumulatingStrategy as AccumulatingStrategy
from ._pmap import PmapStrategy as PmapStrategy
from ._sharding import ShardingStrategy as ShardingStrategy
from ._strategy import PerDeviceStrategy as PerDeviceStrategy, Strategy as Strategy
