"""`px.callbacks.TensorBoardLogger`: a run's metrics as TensorBoard scalars,
written with tensorboardX into event files.

What is logged when is `ScalarLogger`'s; this module opens, flushes and
closes the event files, and after a resume tells TensorBoard to hide what
the interrupted process wrote past its checkpoint. It needs tensorboardX
(an optional extra) and reads nothing of the trainer.
"""

import logging
import os
import time
from typing import TYPE_CHECKING, Any, final

from typing_extensions import override

from .._typing import validates_own_arguments
from ._base import StepInfo
from ._files import check_file_path
from ._scalar_logger import ScalarLogger


if TYPE_CHECKING:
    from tensorboardX import SummaryWriter

_FLUSH_EVERY_S = 1.0


@final
class TensorBoardLogger(ScalarLogger):
    """Writes metrics as TensorBoard scalars (with tensorboardX).

    Every `log_every` steps the step's own metrics go to ``train/<name>``; at
    each epoch end the epoch's train means go to ``epoch/<name>`` and its
    evaluation to ``eval/<name>`` (``eval_loss`` → ``eval/loss``). The x-axis
    of every scalar is the global step (updates made so far), so step,
    epoch and eval curves line up. Values earlier callbacks add (e.g.
    ``lr``) are logged too. TensorBoard stores float32.

    Each `fit` writes a new event file in `logdir` (created if missing),
    flushed at an epoch end a second or more after its last flush (epochs
    of ~0.1 s, as the default ``phalanx train``'s, spent ~1% of the fit
    flushing) and closed when `fit` returns or raises. After
    `load_state_dict`, the next fit tells TensorBoard to hide the events
    that crashed run wrote past the restored step (``purge_step``).

    Requires ``pip install 'phalanx[tensorboard]'``.

    Example:
        ```python
        logger = px.callbacks.TensorBoardLogger("runs/mlp", log_every=50)
        trainer = px.DataParallelTrainer(model, optax.adam(1e-3), callbacks=[logger])
        trainer.fit(data, epochs=3, eval_data=test)
        # tensorboard --logdir runs
        ```
    """

    @validates_own_arguments
    def __init__(self, logdir: str | os.PathLike[str], *, log_every: int = 10):
        """
        Args:
            logdir: the folder for event files; created (with the folders
                above it) at the first fit if missing.
            log_every: log the step's metrics after every this many steps.

        Raises:
            ImportError: tensorboardX is not installed.
            ValueError: `log_every` is not a positive int.
            TypeError: `logdir` is not a str or path.
            NotADirectoryError, PermissionError: `logdir` cannot be written.
        """
        try:
            import tensorboardX  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "TensorBoardLogger needs tensorboardX; install it with "
                "pip install 'phalanx[tensorboard]'"
            ) from error
        super().__init__(log_every)
        self.logdir = check_file_path(logdir, "logdir", directory=True)
        self._writer: SummaryWriter | None = None
        self._last_step: int | None = None
        self._restored = False
        self._flushed = 0.0  # time.monotonic() of the last flush

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        self._open(info.step)

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        super().on_epoch_end(info)
        assert self._writer is not None
        now = time.monotonic()
        if now - self._flushed >= _FLUSH_EVERY_S:
            self._writer.flush()
            self._flushed = now

    def state_dict(self) -> dict[str, Any]:
        """The step of the last scalars written."""
        return {"last_step": self._last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`; the next fit purges events past its step."""
        self._close()
        self._last_step = state["last_step"]
        self._restored = True

    # ----------------------------------------------------------- internals

    def _open(self, step: int) -> None:
        if self._writer is not None:
            return
        # tensorboardX warns on every NaN or inf scalar; a diverging run logs
        # them as they are (its plot shows it), and fails with one clear
        # error of its own at the next sync.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)
        from tensorboardX import SummaryWriter

        # TensorBoard hides earlier events with step >= purge_step: those the
        # crashed run logged after the checkpoint this run resumes from (the
        # saved state cannot tell whether it logged any: purge regardless).
        self._writer = SummaryWriter(
            str(self.logdir), purge_step=step + 1 if self._restored else None
        )
        self._restored = False

    @override
    def _log(self, scalars: dict[str, float], step: int) -> None:
        from tensorboardX.summary import scalar

        self._open(step)
        assert self._writer is not None
        # One event of all the step's scalars (as TensorFlow's merged
        # summaries), not an event each (`add_scalar`): 9 us a scalar, not 66.
        merged = None
        for tag, value in scalars.items():
            one = scalar(tag, value)
            if merged is None:
                merged = one
            else:
                merged.MergeFrom(one)  # (appends its value)
        if merged is not None:
            self._writer._get_file_writer().add_summary(merged, step)
        self._last_step = step

    @override
    def _close(self, error: BaseException | None = None) -> None:
        del error
        if self._writer is not None:
            self._writer.close()
            self._writer = None
