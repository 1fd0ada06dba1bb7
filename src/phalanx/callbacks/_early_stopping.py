"""`px.callbacks.EarlyStopping`: ends `fit` when a monitored metric stops
improving, and can put the best state back.

It decides from the global values every process sees alike, so it runs on
every process; it declares the metric it reads (`monitors`), checked before
the fit starts, and keeps its counters (never the weights) in checkpoints.
"""

from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from typing_extensions import override

from .._state._train_state import TrainState
from .._typing import validates_own_arguments
from .._validate import boolean, positive_int
from ._base import StepInfo
from ._watch import AbstractWatch


class EarlyStopping(AbstractWatch):
    """Ends `fit` when a metric has stopped improving for `patience` epochs
    (or evaluations).

    After each epoch it reads `monitor` from the epoch's metrics; an
    ``eval_`` metric of a fit that evaluates every ``eval_every`` steps it
    reads after each of those evaluations instead (Lightning's
    ``val_check_interval``), counting evaluations where this says epochs.
    An epoch improves on the best so far when the value is lower
    (``mode="min"``) or higher (``mode="max"``) by more than `min_delta`;
    NaN never improves. After `patience` epochs in a row without improvement
    it sets ``trainer.stop_training``, and `fit` returns after that epoch
    (after that evaluation's step).

    With `restore_best_weights`, it keeps a device copy of the whole
    `TrainState` of the best epoch (one state's worth of device memory) and
    puts it back into the trainer when it stops, or when `fit` ends otherwise
    after a worse epoch. The whole state is restored: model, optimizer state,
    key, and step (so a later `fit` continues from the best epoch); the
    history keeps every epoch.

    Its count carries across `fit` calls, so a run split into several fits
    behaves as one; make a new one to start over. `state_dict` holds the
    count and the best value, not the weights.

    Place it **after** any callback that adds the monitored metric.

    Args:
        monitor: the epoch metric to watch, e.g. ``"eval_loss"`` (needs
            ``fit(eval_data=...)``) or ``"loss"``.
        mode: ``"min"`` if lower is better, ``"max"`` if higher is.
        patience: stop after this many epochs (or evaluations) in a row
            without improvement.
        min_delta: the least change that counts as an improvement.
        restore_best_weights: put the best epoch's state back at the end.

    Raises:
        TypeError, ValueError: an argument is invalid (the message names it).

    Example:
        ```python
        stopper = EarlyStopping("eval_accuracy", mode="max", patience=5,
                                restore_best_weights=True)
        trainer = px.DataParallelTrainer(model, optax.adam(1e-3),
                                         callbacks=[stopper])
        trainer.fit(train, epochs=100, eval_data=test)
        stopper.best_epoch, stopper.best  # the model now holds that epoch's weights
        ```

        Every 100 steps, on one of several sets:

        ```python
        stopper = EarlyStopping("eval_val_loss", patience=4)
        trainer = px.DataParallelTrainer(model, optax.adam(1e-3),
                                         callbacks=[stopper])
        trainer.fit(train, steps=2_000, eval_every=100,
                    eval_data={"val": val, "test": test})
        stopper.best_step
        ```
    """

    @validates_own_arguments
    def __init__(
        self,
        monitor: str = "eval_loss",
        *,
        mode: Literal["min", "max"] = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        restore_best_weights: bool = False,
    ) -> None:
        super().__init__(monitor, mode, min_delta)
        self.patience = positive_int("patience", patience, example="3")
        self.restore_best_weights = boolean(
            "restore_best_weights", restore_best_weights
        )
        self.best_epoch: int | None = None
        self.best_step: int | None = None
        self.stopped_epoch: int | None = None
        self._best_state: TrainState | None = None
        self._last_step: int | None = None  # of the last value judged

    @override
    def added_metrics(self) -> tuple[str, ...]:
        """Nothing: it only reads its monitor."""
        return ()

    @override
    def _judge(self, info: StepInfo, value: float) -> None:
        """Count `value`, the monitor's at this point; stop after `patience`."""
        self._last_step = info.step
        if self.improves(value):
            self.best, self.wait = value, 0
            self.best_epoch, self.best_step = info.epoch, info.step
            if self.restore_best_weights:
                # The next step donates the trainer's buffers: copy them now.
                self._best_state = jax.tree.map(
                    lambda x: jnp.copy(x) if eqx.is_array(x) else x, info.state
                )
            return
        self.wait += 1
        if self.wait >= self.patience:
            self.stopped_epoch = info.epoch
            info.stop()
            if info.eval_every is None:
                self._restore(info)
            # else at fit's end, once this step's other hooks have run

    @override
    def on_fit_end(self, info: StepInfo) -> None:
        self._restore(info)

    def _restore(self, info: StepInfo) -> None:
        """Put the best state back, unless the last value judged was the best."""
        if (
            self.restore_best_weights
            and self._best_state is not None
            and self._last_step != self.best_step
        ):
            info.trainer.state = self._best_state
            self._last_step = self.best_step

    def state_dict(self) -> dict[str, Any]:
        """The best value, its epoch and step, and the count of epochs (or
        evaluations) since (no weights)."""
        return {
            **super().state_dict(),
            "best_epoch": self.best_epoch,
            "best_step": self.best_step,
            "stopped_epoch": self.stopped_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`; best weights are not restored (none kept)."""
        super().load_state_dict(state)
        self.best_epoch = state["best_epoch"]
        self.best_step = state.get("best_step")  # None from earlier versions
        self.stopped_epoch = state["stopped_epoch"]
        self._best_state = None
