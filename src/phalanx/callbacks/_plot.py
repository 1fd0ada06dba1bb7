"""`px.callbacks.PlotHistory`: the trainer's `History` drawn to an image
file on a thread of its own, redrawn at epoch ends within a share of the
fit's time, and once more when `fit` returns.

It draws a copy of the history with matplotlib's Agg canvas (never pyplot,
so a user's figures and backend are left alone), replaces the file
atomically, and only reads the history: it adds no metric.
"""

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import override

from .._state._history import History
from .._telemetry._files import replace_atomically
from .._typing import validates_own_arguments
from .._validate import finite_at_least
from ._background import Background
from ._base import StepInfo
from ._budget import TimeBudget
from ._files import check_file_path
from ._output import Output
from ._plot_curves import curves, eval_names, evaluated_between_epochs, is_eval_of


# What a first drawing is taken to cost before one has been timed (a
# figure of a few panels took 0.3-0.5 s on a 2-core CPU host).
_FIRST_DRAWING_S = 0.5


class PlotHistory(Output):
    """Draws the trainer's `History` to an image: a panel per metric, train
    and eval curves over epochs (or steps).

    The image is drawn on a thread of its own (the thread running `fit`
    goes on training), when `fit` returns and at epoch ends as often as
    `max_share` allows: a redraw waits until the time since the last one is
    at least what that one took ÷ `max_share` (with the default 0.02, a
    drawing of 0.4 s waits 20 s, so drawing takes at most ~2% of a fit's
    time; before the first drawing is timed it is taken to cost 0.5 s). A
    history unchanged since the last drawing is not drawn again. `fit`
    returns without waiting for its last drawing: call `wait` before
    reading the file in the same process (a Python process waits for it
    before it exits). The file is replaced atomically (a viewer never sees
    half a file). Each panel shows a metric (``loss``, ``accuracy``, values
    other callbacks add such as ``lr``) against epochs completed, with its
    ``eval_`` counterpart beside it when there is one (one per set, for
    named eval sets); points are marked, so one epoch shows as a dot. After
    ``fit(eval_every=N)`` the x-axis is steps: the epochs' train means at
    the steps they ended, each evaluation at its step.

    Drawing uses matplotlib's Agg canvas directly, never pyplot: the user's
    backend and open figures are left alone, and it works without a display.
    The file format follows the suffix of `path` (``.png``, ``.pdf``,
    ``.svg``, ...).

    Requires ``pip install 'phalanx[plot]'``.

    Example:
        ```python
        plot = px.callbacks.PlotHistory("history.png", metrics=["loss", "accuracy"])
        trainer = px.DataParallelTrainer(model, optax.adam(1e-3), callbacks=[plot])
        trainer.fit(data, epochs=10, eval_data=test)
        plot.wait()  # history.png shows the whole fit
        ```
    """

    @validates_own_arguments
    def __init__(
        self,
        path: str | os.PathLike[str] = "history.png",
        *,
        metrics: Sequence[str] | None = None,
        max_share: float = 0.02,
    ):
        """
        Args:
            path: the image file; its folder is created if needed.
            metrics: train metric names to draw, a panel each (their ``eval_``
                curves come along); default every metric in the history but
                `Timeline`'s ``time/<phase>`` seconds (its table's).
            max_share: the share of the fit's time redrawing at epoch ends
                may take, in (0, 1]; 1 redraws at every epoch end.

        Raises:
            ImportError: matplotlib is not installed.
            TypeError, ValueError: an argument is invalid.
            NotADirectoryError, IsADirectoryError, PermissionError: `path`
                cannot be written.
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
        except ImportError as error:
            raise ImportError(
                "PlotHistory needs matplotlib; install it with "
                "pip install 'phalanx[plot]'"
            ) from error
        self.path = check_file_path(path, "path", example="history.png")
        self.format = self.path.suffix.removeprefix(".").lower()
        formats = sorted(FigureCanvasAgg.get_supported_filetypes())
        if self.format not in formats:
            raise ValueError(
                f"path={str(path)!r} has no image suffix matplotlib writes; "
                f"end it with one of {['.' + f for f in formats]}, e.g. 'history.png'"
            )
        self.metrics = _check_metrics(metrics)
        self.max_share = finite_at_least(
            "max_share", max_share, 0.0, example="max_share=0.02 (2% of the time)"
        )
        if not 0 < self.max_share <= 1:
            raise ValueError(
                f"{max_share=} must be in (0, 1]: the share of the fit's time "
                "drawing may take, e.g. max_share=0.02 (2%), or 1 to redraw "
                "at every epoch end"
            )
        # The history last drawn to `path`, as plain data: drawing takes
        # ~0.5 s, and fit often ends right after an epoch end drew it.
        self._drawn: dict[str, Any] | None = None
        self._budget = TimeBudget(self.max_share, first=_FIRST_DRAWING_S)
        self._drawer = Background(f"PlotHistory drawing {self.path}")

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        del info
        self._budget.restart()

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        # (With max_share < 1, an epoch end while a drawing runs draws nothing.)
        if self._budget.due() and (self.max_share >= 1 or not self._drawer.busy):
            self._draw(info.history)

    @override
    def on_fit_end(self, info: StepInfo) -> None:
        # Drawn once the fit has ended (its clock stopped): a drawing thread
        # busy while checkpoint saves finish slowed the last one's commit,
        # which fit waits for, from ~35 ms to ~190 ms (2 cores).
        clock = info.clock
        self._draw(info.history, after=None if clock is None else clock.ended)

    @override
    def _close(self, error: BaseException | None = None) -> None:
        """Nothing to close: the drawing thread ends its last drawing after
        `fit` returns (`wait` waits for it), and nothing is drawn where `fit`
        raised."""
        del error

    def wait(self) -> None:
        """Return once the drawings handed to the drawing thread are in the
        file.

        Raises:
            OSError: a drawing could not be written (raised once, here or at
                the next drawing).
        """
        self._drawer.wait()

    def _draw(
        self, history: History, *, after: Callable[[], bool] | None = None
    ) -> None:
        """Hand a copy of `history` to the drawing thread, unless the file
        already shows it; with `after`, drawn once it is true (looked at
        every 10 ms, for a minute at most).

        Raises:
            ValueError: `metrics` names one the history lacks.
            OSError: an earlier drawing could not be written.
        """
        drawn = history.state_dict()
        if drawn == self._drawn:
            return  # the file already shows it
        names = self._names(history)  # checked here: an error stops fit
        if not names:
            return
        copy = History()
        copy.load_state_dict(drawn)
        self._drawer.submit(lambda: self._spend_drawing(copy, names, after))
        self._drawn = drawn

    def _spend_drawing(
        self, history: History, names: list[str], after: Callable[[], bool] | None
    ) -> None:
        """Draw (once `after` is true, if given), timed: the time between
        redraws follows from it."""
        waited = 0
        while after is not None and not after() and waited < 6000:
            time.sleep(0.01)
            waited += 1
        with self._budget.spend():
            self._draw_names(history, names)

    def _draw_names(self, history: History, names: list[str]) -> None:
        """Draw a panel for each of `names` into `path`."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        columns = min(len(names), 3)
        rows = -(-len(names) // columns)
        figure = Figure(figsize=(4 * columns, 3 * rows), layout="constrained")
        FigureCanvasAgg(figure)
        by_step = evaluated_between_epochs(history)
        for i, name in enumerate(names):
            axes = figure.add_subplot(rows, columns, i + 1)
            for label, xs, ys in curves(history, name, by_step=by_step):
                axes.plot(xs, ys, marker="o", ms=4, label=label)
            axes.set_title(name)
            axes.set_xlabel("step" if by_step else "epoch")
            axes.xaxis.set_major_locator(MaxNLocator(integer=True))
            axes.grid(alpha=0.3)
            axes.legend()
        replace_atomically(
            self.path, lambda file: figure.savefig(file, format=self.format)
        )

    def _names(self, history: History) -> list[str]:
        present = history.scalar_names
        evals = eval_names(history)
        train = [name for name in present if not name.startswith("eval_")]
        if self.metrics is None:
            # A panel for each of nine phases would crowd out the metrics.
            train = [name for name in train if not name.startswith("time/")]
            alone = [
                name.removeprefix("eval_")
                for name in evals
                if not any(is_eval_of(name, metric) for metric in train)
            ]
            return list(dict.fromkeys([*train, *alone]))
        for name in self.metrics:
            if name not in present and not any(is_eval_of(e, name) for e in evals):
                raise ValueError(
                    f"PlotHistory(metrics={self.metrics!r}): the history has no "
                    f"{name!r}; it has {present}; pass names from those"
                )
        return self.metrics


def _check_metrics(metrics: object) -> list[str] | None:
    if metrics is None:
        return None
    if isinstance(metrics, str) or not isinstance(metrics, Sequence):
        raise TypeError(
            f"metrics={metrics!r} must be a list of metric names or None, "
            "e.g. metrics=['loss', 'accuracy']"
        )
    if not metrics:
        raise ValueError(
            "metrics=[] names no metric; pass names such as ['loss'], or None for all"
        )
    for name in metrics:
        if not isinstance(name, str):
            raise TypeError(
                f"metrics={metrics!r} holds {name!r}, not a str; pass metric "
                "names, e.g. metrics=['loss', 'accuracy']"
            )
        if name.startswith("eval_"):
            raise ValueError(
                f"metrics={metrics!r} holds {name!r}; pass the train name "
                f"{name.removeprefix('eval_')!r}: its eval curve is drawn with it"
            )
    if len(set(metrics)) != len(metrics):
        raise ValueError(f"metrics={metrics!r} repeats a name; list each once")
    return list(metrics)
