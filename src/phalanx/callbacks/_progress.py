import datetime

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

from .._callback import Callback, StepInfo
from .._typing import HostMetrics, validates_own_arguments
from .._validate import positive_int
from ._throughput import RateMeter


# The per-epoch table: (heading, metric, width). Optional columns show only if
# the first epoch of a fit has the metric; "ex/s" and "time" are measured here.
_COLUMNS = (
    ("epoch", "epoch", 7),
    ("loss", "loss", 8),
    ("accuracy", "accuracy", 8),
    ("ex/s", "ex/s", 9),
    ("eval loss", "eval_loss", 9),
    ("eval acc", "eval_accuracy", 8),
    ("time", "time", 7),
)
_OPTIONAL = ("accuracy", "eval_loss", "eval_accuracy")


class ProgressBar(Callback):
    """Shows training progress with `rich`, and a table row per epoch.

    On a terminal, a live bar shows the step out of the fit's total (a
    running count when the total is unknown), the loss, examples per second
    and the time left. Elsewhere (CI, captured or piped output) it prints a
    plain line instead. Both are refreshed every `log_every` steps, the only
    points at which it reads the step's metrics (each read waits for the
    device; rates are measured between those points). After each epoch it
    prints a row: epoch, loss, accuracy, examples/s, eval loss, eval accuracy
    (those present) and the epoch's time, evaluation included. Examples per
    second are measured here, or taken from a `Throughput` placed before it.

    Args:
        log_every: steps between refreshes.
        console: where to draw; default a new `rich.console.Console()`
            (standard output). Its ``is_terminal`` picks the bar or plain lines.

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
        ```
    """

    main_process_only = True  # written once, by process 0

    @validates_own_arguments
    def __init__(self, *, log_every: int = 10, console: Console | None = None) -> None:
        self.log_every = positive_int("log_every", log_every, example="log_every=10")
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
        self._columns: tuple[tuple[str, str, int], ...] | None = None

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        self._close()
        self._out = out = self.console if self.console is not None else Console()
        self._first_step = info.step  # of this fit (a resume starts later)
        self._run_start = info.start_step
        self._first_epoch = info.start_epoch
        self._total = info.total_steps
        self._max_epochs = info.max_epochs
        self._columns = None
        self._fit.restart()
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

    @override
    def on_step_end(self, info: StepInfo) -> None:
        self._window.add(info.examples)
        self._epoch.add(info.examples)
        self._fit.add(info.examples)
        if info.step % self.log_every != 0:
            return
        metrics = info.metrics  # waits for this step: the rate is real
        # An earlier Throughput's figure, if any, so the two agree.
        rate = metrics.get("examples_per_sec", self._window.rates()[0])
        loss = metrics["loss"]
        self._window.restart()
        # Steps of the run (a resumed run goes on counting), and of this fit.
        done, fit_done = info.step - self._run_start, info.step - self._first_step
        if self._progress is not None:
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
        values: HostMetrics = dict(info.metrics)
        values["ex/s"] = values.get("examples_per_sec", self._epoch.rates()[0])
        values["time"] = self._epoch.seconds()
        if self._columns is None:
            self._columns = tuple(
                column
                for column in _COLUMNS
                if column[1] not in _OPTIONAL or column[1] in values
            )
            heading = "  ".join(f"{name:>{width}}" for name, _, width in self._columns)
            self._print(Text(heading, style="bold"))
        cells = [self._cell(info.epoch, values, column) for column in self._columns]
        self._print(Text("  ".join(cells)))
        if self._progress is not None:
            self._progress.update(self._task, completed=info.step - self._run_start)

    @override
    def on_fit_end(self, info: StepInfo) -> None:
        del info
        self._close()

    @override
    def on_exception(self, info: StepInfo, error: BaseException) -> None:
        del info, error
        self._close()

    def _close(self) -> None:
        """Stop the live display, leaving its last frame on screen."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def _print(self, text: Text) -> None:
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

    def _cell(
        self, epoch: int, values: HostMetrics, column: tuple[str, str, int]
    ) -> str:
        _, metric, width = column
        if metric == "epoch":
            text = self._epoch_number(epoch)
        elif metric not in values:
            text = "-"
        elif metric == "ex/s":
            text = f"{values[metric]:,.0f}"
        elif metric == "time":
            seconds = values[metric]
            text = f"{seconds:.2f}s" if seconds < 10 else f"{seconds:,.0f}s"
        else:
            text = f"{values[metric]:.4f}"
        return f"{text:>{width}}"
