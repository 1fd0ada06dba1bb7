"""`Background`: a callback's slow work (drawing a plot) run on a thread of
its own, one piece at a time, so that the thread running `fit` goes on.

A piece of work that fails is reported where the callback next hands one
over or waits (and logged when it fails, in case neither happens). The
thread is started at the first piece; the interpreter waits for the work
handed over before it exits (`concurrent.futures` joins its threads). It
knows nothing of what the work is.
"""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .._log import logger


class Background:
    """Runs work handed over on one thread, in order."""

    def __init__(self, name: str):
        self.name = name
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self._failure: BaseException | None = None

    @property
    def busy(self) -> bool:
        """Whether work handed over has not ended yet."""
        return self._pending is not None and not self._pending.done()

    def submit(self, work: Callable[[], None]) -> None:
        """Run `work` after what was handed over before.

        Raises:
            Exception: the error of work that failed before (once).
        """
        self._raise_failure()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, self.name)
        self._pending = self._executor.submit(self._run, work)

    def wait(self) -> None:
        """Return once the work handed over has ended.

        Raises:
            Exception: the error of work that failed (once).
        """
        pending = self._pending
        if pending is not None:
            pending.result()
        self._raise_failure()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as error:
            logger.warning(f"{self.name} failed: {error!r}")
            self._failure = error

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
