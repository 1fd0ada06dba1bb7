"""The learning-rate range test behind `DataParallelTrainer.find_lr`
(Lightning's ``Tuner.lr_find``, after Smith, "Cyclical Learning Rates"):
train from the current state with a learning rate rising geometrically
from `start` to `end`, one step per rate, and record the loss; the state
the trainer had is put back afterwards, to the bit.

Each rate is set through phalanx's rate multiplier (`TrainState.lr_scale`):
the rate wanted divided by the optimizer's own rate for that update (read
from the optimizer and its state, a schedule's included), so the sweep
takes the same absolute rates on any optimizer whose rate phalanx can read.
"""

import dataclasses
import math
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from ..._state._learning_rate import next_rate
from ..._state._train_state import TrainState
from ..._typing import validates_own_arguments
from ..._validate import int_at_least, is_real


# Lightning's: the loss smoothed exponentially, and the sweep stopped once it
# exceeds this many times the best smoothed loss (it has diverged).
SMOOTHING = 0.98
DIVERGED = 4.0
# The suggestion ignores the first and last points (Lightning's skip_begin,
# skip_end): the smoothing's start and the divergence.
SKIP_BEGIN, SKIP_END = 10, 1


@dataclasses.dataclass(frozen=True)
class LRFinderResult:
    """What `find_lr` measured.

    Attributes:
        lrs: the learning rate of each step taken.
        losses: each step's training loss (on its batch, before the update).
        smoothed: the losses smoothed exponentially (factor 0.98, with
            Adam's bias correction), what the suggestion reads.
        suggestion: the rate where the smoothed loss falls fastest (the
            steepest negative slope against log-rate, the first 10 and the
            last point left out); None when too few points remain.
    """

    lrs: tuple[float, ...]
    losses: tuple[float, ...]
    smoothed: tuple[float, ...]
    suggestion: float | None

    def plot(self, path: str | os.PathLike[str]) -> None:
        """Draw the smoothed loss against the learning rate (log scale),
        the suggestion marked, into the image file `path`, its folders made
        where missing (matplotlib's Agg canvas: no display needed;
        ``pip install 'phalanx[plot]'``)."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as error:
            raise ImportError(
                "LRFinderResult.plot needs matplotlib; install it with "
                "pip install 'phalanx[plot]'"
            ) from error
        figure = Figure(figsize=(5, 3.5), layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        axes.plot(self.lrs, self.smoothed, label="loss (smoothed)")
        if self.suggestion is not None:
            axes.axvline(self.suggestion, color="red", linestyle="--")
            axes.set_title(f"suggested learning rate {self.suggestion:.2e}")
        axes.set_xscale("log")
        axes.set_xlabel("learning rate")
        axes.set_ylabel("loss")
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(os.fspath(path))


def base_rate(optimizer: optax.GradientTransformation, state: TrainState) -> float:
    """The optimizer's own rate for the next update from `state`.

    Raises:
        TypeError: phalanx cannot read it (the message says why).
    """
    base = next_rate(optimizer, state.opt_state)
    if base.value is None:
        raise TypeError(
            f"find_lr sets absolute rates through the optimizer's rate, but "
            f"phalanx cannot read the optimizer's learning rate: {base.why}; "
            "sweep an optimizer that ends with its rate, e.g. optax.adam(1e-3) "
            "or optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))"
        )
    return base.value


def sweep(
    state: TrainState,
    data: Iterable[Any],
    lrs: np.ndarray,
    *,
    optimizer: optax.GradientTransformation,
    set_state: Callable[[TrainState], None],
    step: Callable[[Any], tuple[float, TrainState]],
) -> LRFinderResult:
    """One step per rate of `lrs` from `state`, on `data`'s batches (read
    again from the start when they run out), until the loss diverges.

    A step whose own rate is 0 (a warmup from 0) is taken as training would
    take it (no multiplier gives it a rate) and is not one of the sweep's:
    its loss is not recorded and the next step takes the same rate.

    Args:
        state: where the sweep starts.
        data: the batches.
        lrs: the rates.
        optimizer: the optax transformation the steps apply.
        set_state: makes a state the trainer's.
        step: from the trainer's state, a batch's loss and the state the
            update leads to (without applying it).

    Raises:
        TypeError: phalanx cannot read the optimizer's rate.
        ValueError: the optimizer's rate stays 0 for `len(lrs)` steps in a
            row: there is nothing to sweep.
    """
    batches = _endless(data)
    taken: list[float] = []
    losses: list[float] = []
    smoothed: list[float] = []
    average, best, idle = 0.0, math.inf, 0
    for lr in lrs:
        base = base_rate(optimizer, state)
        while base == 0.0:  # no multiplier gives this update a rate
            idle += 1
            if idle >= len(lrs):
                raise ValueError(
                    f"find_lr: the optimizer's learning rate is 0 for {idle} "
                    "steps in a row (a schedule's warmup from 0?), so no "
                    "multiplier gives them a rate; start the schedule above "
                    "0, or sweep with a constant rate, e.g. optax.adam(1e-3)"
                )
            set_state(state)
            state = step(next(batches))[1]
            base = base_rate(optimizer, state)
        idle = 0
        scale = jnp.asarray(float(lr) / base, jnp.float32)
        set_state(dataclasses.replace(state, lr_scale=scale))
        loss, state = step(next(batches))
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
        value = average / (1 - SMOOTHING ** (len(taken) + 1))
        taken.append(float(lr))
        losses.append(loss)
        smoothed.append(value)
        if not math.isfinite(value) or value > DIVERGED * best:
            break
        best = min(best, value)
    return LRFinderResult(
        tuple(taken), tuple(losses), tuple(smoothed), _suggestion(taken, smoothed)
    )


def _suggestion(lrs: list[float], smoothed: list[float]) -> float | None:
    """The rate at the steepest descent of the smoothed loss."""
    kept = np.asarray(smoothed[SKIP_BEGIN : len(smoothed) - SKIP_END])
    finite = np.isfinite(kept)
    if finite.sum() < 2:
        return None
    index = np.flatnonzero(finite)
    slope = np.gradient(kept[finite], np.log(np.asarray(lrs))[SKIP_BEGIN:][index])
    return float(lrs[SKIP_BEGIN + index[int(np.argmin(slope))]])


def _endless(data: Iterable[Any]) -> Iterator[Any]:
    """`data`'s batches, over and over.

    Raises:
        ValueError: `data` has no batch.
    """
    while True:
        empty = True
        for batch in data:
            empty = False
            yield batch
        if empty:
            raise ValueError("data has no batch; pass at least one, e.g. [(x, y)]")


@validates_own_arguments
def range_test(
    state: TrainState,
    data: Iterable[Any],
    rates: tuple[float, float, int],
    *,
    optimizer: optax.GradientTransformation,
    compute_step: Callable[[Any], Any],
    set_state: Callable[[TrainState], None],
) -> LRFinderResult:
    """`sweep` from `state` over `steps` rates from `start` to `end` (the
    `rates` triple, checked here), each step computed by `compute_step`
    (its `StepValues`); `state` is set back at the end, whatever happens.

    Raises:
        TypeError: the optimizer's rate cannot be read.
        ValueError: bad rates or steps (see `DataParallelTrainer.find_lr`).
    """
    start, end, steps = rates
    if not (
        is_real(start) and is_real(end) and 0 < float(start) < float(end) < math.inf
    ):
        raise ValueError(
            f"start={start!r}, end={end!r} must be rates with 0 < start < "
            "end, e.g. start=1e-7, end=10.0"
        )
    steps = int_at_least("steps", steps, 2, example="100")
    base_rate(optimizer, state)  # readable: checked before any step

    def step(batch: Any) -> tuple[float, TrainState]:
        values = compute_step(batch)
        return float(values.metrics["loss"]), values.state

    try:
        return sweep(
            state,
            data,
            np.geomspace(float(start), float(end), steps),  # even in log
            optimizer=optimizer,
            set_state=set_state,
            step=step,
        )
    finally:
        set_state(state)
