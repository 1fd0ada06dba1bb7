"""`TimeBudget`: when a callback's slow, repeatable work (drawing a plot,
rewriting a file) may run again, so that it takes at most a share of the
fit's time.

It only measures and answers; what the work is, and when it is asked, is
the callback's.
"""

import contextlib
import time
from collections.abc import Iterator


class TimeBudget:
    """Lets work run again once the time since it last ended is at least its
    last duration ÷ `share` (and at least `floor` seconds), so that it takes
    at most about `share` of the time: with ``share=0.02``, a drawing that
    took 0.4 s waits 20 s.

    Before its first run, the time is counted from `restart` (a fit's
    start) and the work is taken to cost `first` seconds. A `share` of 1 or
    more lets it run whenever asked.

    Example:
        ```python
        from phalanx.callbacks._budget import TimeBudget

        budget = TimeBudget(0.02, first=0.5)
        if budget.due():  # False: 0.5 s / 0.02 = 25 s have not passed
            with budget.spend():
                print("drawing")
        ```
    """

    def __init__(self, share: float, *, first: float, floor: float = 0.0):
        self.share = share
        self.floor = floor
        # The last run's seconds (kept across restarts: the same work again).
        self.cost = first
        self._ended = time.perf_counter()

    def restart(self) -> None:
        """Count the wait from now (a fit starts: the work has not run yet)."""
        self._ended = time.perf_counter()

    def due(self) -> bool:
        """Whether the work may run now."""
        if self.share >= 1:
            return True
        wait = max(self.cost / self.share, self.floor)
        return time.perf_counter() - self._ended >= wait

    @contextlib.contextmanager
    def spend(self) -> Iterator[None]:
        """Run the work in this block: its seconds are the next wait's measure."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self._ended = time.perf_counter()
            self.cost = self._ended - began
