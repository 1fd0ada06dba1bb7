"""phalanx's callbacks: the `Callback` base, what a hook is told
(`StepInfo`), and the built-in callbacks (checkpoints, early stopping,
the learning rate on a plateau, loggers, trackers, displays, the profiler,
the timeline).

This module only re-exports; each callback lives in a private module of its
own, and the dispatcher that calls them (`_dispatch`) is not public.
"""

from ._base import (
    Callback as Callback,
    StepInfo as StepInfo,
    TrainerLike as TrainerLike,
)
from ._checkpoint import Checkpoint as Checkpoint
from ._csv_logger import CSVLogger as CSVLogger
from ._early_stopping import EarlyStopping as EarlyStopping
from ._json_logger import JSONLogger as JSONLogger
from ._lr_monitor import LearningRateMonitor as LearningRateMonitor
from ._mlflow import MLflowLogger as MLflowLogger
from ._plot import PlotHistory as PlotHistory
from ._profiler import Profiler as Profiler
from ._progress_bar import ProgressBar as ProgressBar
from ._reduce_lr import ReduceLROnPlateau as ReduceLROnPlateau
from ._tensorboard import TensorBoardLogger as TensorBoardLogger
from ._throughput import Throughput as Throughput
from ._timeline import Timeline as Timeline
from ._tracker_error import TrackerError as TrackerError
from ._wandb import WandbLogger as WandbLogger
