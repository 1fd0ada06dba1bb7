import os
from collections.abc import Sequence

from typing_extensions import override

from .._callback import Callback, StepInfo
from .._history import History
from .._typing import validates_own_arguments
from ._files import check_file_path, replace_atomically


class PlotHistory(Callback):
    """Draws the trainer's `History` to an image: a panel per metric, train
    and eval curves over epochs.

    The image is redrawn at every epoch end and when `fit` returns, and
    replaced atomically (a viewer never sees half a file). Each panel shows a
    metric (``loss``, ``accuracy``, values earlier callbacks add such as
    ``lr``) against epochs completed, with its ``eval_`` counterpart beside
    it when there is one; points are marked, so one epoch shows as a dot.

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
        ```
    """

    main_process_only = True  # written once, by process 0

    @validates_own_arguments
    def __init__(
        self,
        path: str | os.PathLike[str] = "history.png",
        *,
        metrics: Sequence[str] | None = None,
    ):
        """
        Args:
            path: the image file; its folder is created if needed.
            metrics: train metric names to draw, a panel each (their ``eval_``
                curves come along); default every metric in the history.

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

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        self._draw(info.history)

    @override
    def on_fit_end(self, info: StepInfo) -> None:
        self._draw(info.history)

    def _draw(self, history: History) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        names = self._names(history)
        if not names:
            return
        columns = min(len(names), 3)
        rows = -(-len(names) // columns)
        figure = Figure(figsize=(4 * columns, 3 * rows), layout="constrained")
        FigureCanvasAgg(figure)
        epochs = range(1, len(history) + 1)
        for i, name in enumerate(names):
            axes = figure.add_subplot(rows, columns, i + 1)
            for label, key in (("train", name), ("eval", f"eval_{name}")):
                if key in history.names:
                    axes.plot(epochs, history[key], marker="o", ms=4, label=label)
            axes.set_title(name)
            axes.set_xlabel("epoch")
            axes.xaxis.set_major_locator(MaxNLocator(integer=True))
            axes.grid(alpha=0.3)
            axes.legend()
        replace_atomically(
            self.path, lambda file: figure.savefig(file, format=self.format)
        )

    def _names(self, history: History) -> list[str]:
        present = history.names
        if self.metrics is None:
            return list(dict.fromkeys(name.removeprefix("eval_") for name in present))
        for name in self.metrics:
            if name not in present and f"eval_{name}" not in present:
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
