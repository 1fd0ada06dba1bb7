"""`Output`: what the built-in loggers and displays share, once.

They write the run out (a file of rows, TensorBoard events, a tracker's run,
a progress display), from process 0 only; they add no metric; and whatever
they hold open during a fit is closed when `fit` returns or raises. A
subclass says how it closes (`_close`); it may not add metrics for later
callbacks (a callback that does declares them in `added_metrics`).
"""

import abc

from typing_extensions import override

from ._base import Callback, StepInfo


class Output(Callback, abc.ABC):
    """A callback that writes the run out, and closes what it holds open
    when `fit` returns or raises."""

    main_process_only = True  # written once, by process 0

    @override
    def added_metrics(self) -> tuple[str, ...]:
        """Nothing: an output only reads the metrics."""
        return ()

    @override
    def on_fit_end(self, info: StepInfo) -> None:
        del info
        self._close(None)

    @override
    def on_exception(self, info: StepInfo, error: BaseException) -> None:
        del info
        self._close(error)

    @abc.abstractmethod
    def _close(self, error: BaseException | None = None) -> None:
        """Close what is open (if anything): `error` is what `fit` raised;
        None where it returned, or where the output closes for another
        reason (a new fit, a restored state)."""
