"""The public API of phalanx, imported on first use (see __init__.py)."""

from . import (
    callbacks as callbacks,
    checkpoint as checkpoint,
    data as data,
    distributed as distributed,
    metrics as metrics,
    models as models,
    strategies as strategies,
    testing as testing,
)
from ._engine.program._programs import StepValues as StepValues
from ._engine.run._lr_finder import LRFinderResult as LRFinderResult
from ._plan._devices import DeviceSpec as DeviceSpec, calibrate as calibrate
from ._plan._from_shapes import plan as plan
from ._plan._result import Plan as Plan, PlanRow as PlanRow
from ._plan._space import PlanSpace as PlanSpace
from ._precision import Precision as Precision
from ._state._history import History as History
from ._state._progress import RunPlan as RunPlan, RunProgress as RunProgress
from ._state._snapshot import Snapshot as Snapshot
from ._state._train_state import DynamicScale as DynamicScale, TrainState as TrainState
from ._telemetry._flops import StepFlops as StepFlops
from ._trainer import DataParallelTrainer as DataParallelTrainer
from ._version import __version__ as __version__
from .callbacks import Callback as Callback, StepInfo as StepInfo
from .checkpoint import load_model as load_model, save_model as save_model
from .distributed._fake_devices import fake_cpu_devices as fake_cpu_devices
from .strategies import (
    AccumulatingStrategy as AccumulatingStrategy,
    FullyShardedStrategy as FullyShardedStrategy,
    MeshStrategy as MeshStrategy,
    PmapStrategy as PmapStrategy,
    ShardingStrategy as ShardingStrategy,
    Strategy as Strategy,
    sharded_model as sharded_model,
)
