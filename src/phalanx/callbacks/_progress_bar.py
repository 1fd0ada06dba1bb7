"""`px.callbacks.ProgressBar`: a run's progress on the console, drawn with
rich: a live bar on a terminal, plain lines elsewhere, and a table row per
epoch.

It reads the step's metrics only at its log points (each read waits for the
device), and declares through `needs_steps` whether a fit must call it after
each step at all; it adds no metric and decides nothing about the run.
"""

import datetime
import math
import time
from typing import IO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text
from typing_extensions import override

from .._telemetry._rates import RateMeter
from .._typing import scalar_metrics, validates_own_arguments
from .._validate import boolean, positive_int
from ._base import StepInfo
from ._epoch_table import EpochTable, evaluation_lines
from ._output import Output


# Seconds between two reads of the step's metrics by the live bar: each read
# waits for the device, so the bar refreshes at most this often (the step
# count still moves at every log point).
_REFRESH_SECONDS = 0.25


class ProgressBar(Output):
    """Shows training progress with `rich`, and a table row per epoch.

    On a terminal, a live bar shows the step out of the fit's total (a
    running count when the total is unknown), the loss, examples per second
    and the time left. Elsewhere (CI, captured or piped output) it prints a
    plain line instead. Both are refreshed every `log_every` steps, the only
    points at which it reads the step's metrics (each read waits for the
    device; rates are measured between those points); the live bar reads
    them at most every 0.25 s, so a fast run does not wait for the device
    at every log point.

    After each epoch it prints a row of every metric the epoch has: the loss,
    each of the model's metrics (a subclass's own included), values other
    callbacks add (e.g. ``lr``), examples per second, every ``eval_`` metric
    and the epoch's time, evaluation included. The table keeps within 100
    characters: where that row would not (several evaluation sets, many
    metrics), each evaluation set has a row of its own under the epoch's,
    in the training metrics' columns, and metrics that still do not fit are
    named once under the heading (the history and loggers have them).
    Examples per second are measured here, or taken from a `Throughput`
    placed before it (its ``steps_per_sec`` is not shown). The heading is
    printed again when the metrics change (e.g. an epoch that also
    evaluates). With
    ``fit(eval_every=N)`` it prints a line of each evaluation's metrics
    after every N-th step (a line per set where one would pass 100
    characters).

    A `DataParallelTrainer` shows one of these by default (with
    ``plain_steps=False``: outside a terminal, one row per epoch, as Keras'
    ``verbose=2``), unless its callbacks hold one or it was made with
    ``progress=False``.

    Args:
        log_every: steps between refreshes.
        console: where to draw; default a new `rich.console.Console()`
            (standard output). Its ``is_terminal`` picks the bar or plain lines.
        plain_steps: outside a terminal, also print a line every `log_every`
            steps (False: only the epoch rows).

    Raises:
        TypeError, ValueError: an argument is invalid (the message names it).

    Example:
        ```python
        trainer = px.DataParallelTrainer(
            model, optax.adam(1e-3), callbacks=[ProgressBar(log_every=20)]
        )
        trainer.fit(train, epochs=3, eval_data=test)
        #   epoch      loss  accuracy       ex/s  eval loss  eval acc     time
        #     1/3    0.6931    0.5012     41,230     0.6012    0.7100     1.2s
        trainer.fit(train, epochs=3, eval_data={"val": val, "test": test})
        #   epoch      loss  accuracy       ex/s     time
        #     1/3    0.6931    0.5012     41,230     1.2s
        #     val    0.6012    0.7100
        #    test    0.6100    0.7000
        ```
    """

    @validates_own_arguments
    def __init__(
        self,
        *,
        log_every: int = 10,
        console: Console | None = None,
        plain_steps: bool = True,
    ) -> None:
        self.log_every = positive_int("log_every", log_every, example="log_every=10")
        self.plain_steps = boolean("plain_steps", plain_steps)
        if console is not None and not isinstance(console, Console):
            raise TypeError(
                f"console={console!r} is not a rich.console.Console; pass one, or "
                "None for standard output"
            )
        self.console = console
        self._out = console
        self._progress: Progress | None = None
        self._task = TaskID(0)
        self._window = RateMeter()
        self._epoch = RateMeter()
        self._fit = RateMeter()
        self._first_step = 0
        self._run_start = 0
        self._first_epoch = 0
        self._total: int | None = None
        self._max_epochs: int | None = None
        self._table: EpochTable | None = None
        self._read_at = -math.inf  # when the live bar last read the metrics
        # Where its own console is no terminal, lines are written there as
        # they are: rich's print to standard output took ~0.3 ms a line.
        self._plain: IO[str] | None = None

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        self._close()
        self._out = out = self.console if self.console is not None else Console()
        self._first_step = info.step  # of this fit (a resume starts later)
        self._run_start = info.start_step
        self._first_epoch = info.start_epoch
        self._total = info.total_steps
        self._max_epochs = info.max_epochs
        self._table = None
        self._fit.restart()
        if info.trainer.ema is not None:
            out.print(
                Text(
                    f"ema={info.trainer.ema}: evaluations use the moving average "
                    "of the weights (trainer.ema_model)"
                ),
                highlight=False,
            )
        plain = self.console is None and not out.is_terminal
        self._plain = out.file if plain else None
        if out.is_terminal:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]} ex/s"),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=out,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                self._epoch_name(info.epoch),
                total=self._total,
                completed=info.step - self._run_start,
                loss="-",
                rate="-",
            )

    @override
    def on_epoch_start(self, info: StepInfo) -> None:
        # The device is idle here: the previous epoch ended with a fetch.
        self._window.restart()
        self._epoch.restart()
        if self._progress is not None:
            self._progress.update(self._task, description=self._epoch_name(info.epoch))

    @property
    @override
    def needs_steps(self) -> bool:
        """Whether the current fit's display is drawn from its steps (a live
        bar, or step lines): with only epoch rows, the trainer's default bar
        is not called after each step."""
        return self._progress is not None or self.plain_steps

    @override
    def on_step_end(self, info: StepInfo) -> None:
        self._window.add(info.examples)
        self._fit.add(info.examples)
        if info.step % self.log_every != 0:
            return
        # Steps of the run (a resumed run goes on counting), and of this fit.
        done, fit_done = info.step - self._run_start, info.step - self._first_step
        if self._progress is None and not self.plain_steps:
            return
        bar = self._progress
        if bar is not None and time.perf_counter() - self._read_at < _REFRESH_SECONDS:
            bar.update(self._task, completed=done)
            return
        metrics = info.metrics  # waits for this step: the rate is real
        # An earlier Throughput's figure, if any, so the two agree.
        rate = metrics.get("examples_per_sec", self._window.rates()[0])
        loss = metrics["loss"]
        self._window.restart()
        if self._progress is not None:
            self._read_at = time.perf_counter()
            self._progress.update(
                self._task, completed=done, loss=f"{loss:.4f}", rate=f"{rate:,.0f}"
            )
            return
        total = "?" if self._total is None else str(self._total)
        line = (
            f"{self._epoch_name(info.epoch)}  step {done}/{total}  loss {loss:.4f}  "
            f"{rate:,.0f} ex/s"
        )
        if self._total is not None and fit_done > 0:
            left = (self._total - done) * self._fit.seconds() / fit_done
            line += f"  eta {datetime.timedelta(seconds=round(left))}"
        self._print(Text(line))

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        values = scalar_metrics(info.metrics)
        seconds = self._epoch.seconds()
        values["ex/s"] = values.get("examples_per_sec", info.examples / seconds)
        values["time"] = seconds
        table = EpochTable.of(values)
        if table != self._table:
            self._table = table
            self._print(Text(table.heading(), style="bold"))
            note = table.note()
            if note is not None:
                self._print(Text(note))
        for line in table.rows(self._epoch_number(info.epoch), values):
            self._print(Text(line))
        if self._progress is not None:
            self._progress.update(self._task, completed=info.step - self._run_start)

    @override
    def on_eval_start(self, info: StepInfo) -> None:
        if info.eval_every is not None and self.needs_steps:  # between two steps
            self._window.pause(info.state)

    @override
    def on_eval_end(self, info: StepInfo) -> None:
        self._window.resume()
        if info.eval_every is None:  # at epoch ends: in the epoch's row
            return
        total = "" if self._total is None else f"/{self._total}"
        step = info.step - self._run_start
        head = f"{self._epoch_name(info.epoch)}  step {step}{total}"
        train = [n for n in info.trainer.history.names if not n.startswith("eval_")]
        for line in evaluation_lines(head, scalar_metrics(info.metrics), train):
            self._print(Text(line))

    @override
    def _close(self, error: BaseException | None = None) -> None:
        """Stop the live display, leaving its last frame on screen."""
        del error
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.stop()

    def _print(self, text: Text) -> None:
        if self._plain is not None:
            self._plain.write(text.plain + "\n")
            self._plain.flush()
            return
        # While the bar is live, the console prints above it.
        if self._out is not None:
            self._out.print(text, highlight=False, soft_wrap=True)

    def _epoch_number(self, epoch: int) -> str:
        """The epoch counted from 1 within the run (across a resume), out of its
        epochs if known."""
        number = str(epoch - self._first_epoch + 1)
        return number if self._max_epochs is None else f"{number}/{self._max_epochs}"

    def _epoch_name(self, epoch: int) -> str:
        return f"epoch {self._epoch_number(epoch)}"
