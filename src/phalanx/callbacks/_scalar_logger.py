"""`ScalarLogger`: what `TensorBoardLogger`, `WandbLogger` and
`MLflowLogger` share, once: which metrics they log, when, and under which
names.

Every `log_every` steps the step's own metrics go to ``train/<name>``; at
each epoch end the epoch's train means go to ``epoch/<name>`` and its
evaluation to ``eval/<name>`` (``eval_loss`` → ``eval/loss``); under
``fit(eval_every=)`` each evaluation is logged when it ends (one at an epoch
end is logged with the epoch's metrics). Every value is logged at the global
step (updates made so far), so every curve shares its x-axis; a value that
is not a real number is left out (an array, such as a confusion matrix,
with one log line the first time). A subclass writes the scalars (`_log`),
may say which steps its run has already (`_has`) and how its tracker spells
a name (`_tag`); it reads nothing of the trainer but what a hook is told.
"""

import abc
from typing import Any

from typing_extensions import override

from .._validate import is_real, positive_int
from ._arrays import numbers_only
from ._base import StepInfo
from ._output import Output


class ScalarLogger(Output, abc.ABC):
    """Logs a run's metrics as scalars, each at its global step."""

    def __init__(self, log_every: object):
        """Check `log_every`: steps between two logs of a step's metrics."""
        self.log_every = positive_int("log_every", log_every, example="log_every=10")

    @override
    def on_step_end(self, info: StepInfo) -> None:
        if info.step % self.log_every == 0 and not self._has(info.step):
            self._log(self._scalars(info.metrics, "train/"), info.step)

    @override
    def on_eval_end(self, info: StepInfo) -> None:
        # Evaluations at epoch ends are logged with their epoch's metrics.
        if info.eval_every is not None and not self._has(info.step):
            self._log(self._scalars(info.metrics), info.step)

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        if not self._has(info.step):
            self._log(self._scalars(info.metrics), info.step)

    def _scalars(self, metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
        """The real values among `metrics` by their tags: under `prefix`, or
        without one, ``eval_<name>`` as ``eval/<name>`` and the others as
        ``epoch/<name>``."""
        scalars = {}
        metrics = numbers_only(metrics)
        for name, value in metrics.items():
            if not is_real(value):
                continue
            if prefix:
                tag = self._tag(prefix, name)
            elif name.startswith("eval_"):
                tag = self._tag("eval/", name.removeprefix("eval_"))
            else:
                tag = self._tag("epoch/", name)
            scalars[tag] = float(value)
        return scalars

    def _tag(self, prefix: str, name: str) -> str:
        """The tracker's name for metric `name` under `prefix` (e.g. ``train/``)."""
        return prefix + name

    def _has(self, step: int) -> bool:
        """Whether the run has values at `step` already (a resumed run's
        replayed steps): nothing more is logged there."""
        del step
        return False

    @abc.abstractmethod
    def _log(self, scalars: dict[str, float], step: int) -> None:
        """Write `scalars` (tag -> value) at `step`."""
