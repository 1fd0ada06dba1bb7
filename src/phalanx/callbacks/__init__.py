from ._callback import Callback as Callback, StepInfo as StepInfo
