"""What a plan shows while it searches (`PlanProgress`): on a terminal, a
live rich bar over the space's candidates (compiled, reused, pruned,
bounded, left, and what it is compiling now); elsewhere, with
``progress=True``, a line per candidate through phalanx's logger, at INFO.

A compile can take a minute on a large model: without this, a plan says
nothing until its table.
"""

import logging
import time
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from .._engine.program._summary import format_bytes
from .._log import logger
from ._result import PlanRow
from ._space import Candidate


# The attribute that marks a plan's progress line: the search drops every
# other phalanx log line while it builds candidates (`_search._quiet`).
MARK = "phalanx_plan_progress"


class PlanProgress:
    """A plan's progress (see module), counted in candidates of its space.

    Args:
        progress: True: the bar on a terminal, log lines elsewhere; None:
            the bar on a terminal, nothing elsewhere; False: nothing.
        console: where the bar goes (default: standard error).
    """

    def __init__(self, progress: bool | None, console: Console | None = None):
        self._console = console if console is not None else Console(stderr=True)
        live = progress is not False and (
            self._console.is_terminal or self._console.is_jupyter
        )
        self._lines = progress is True and not live
        self._bar: Progress | None = None
        if live:
            self._bar = Progress(
                TextColumn("plan"),
                BarColumn(bar_width=12),
                TextColumn("{task.fields[counts]}"),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                console=self._console,
                transient=True,
            )
        self._task = TaskID(0)
        self._total = 0
        self._decided: set[Candidate] = set()
        self.fresh = self.reused = self.pruned = self.bounded = 0
        self._began = 0.0

    def __enter__(self) -> "PlanProgress":
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task("", total=None, counts="")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        del kind, error, traceback
        if self._bar is not None:
            self._bar.stop()

    def start(self, candidates: int, devices: int) -> None:
        """The search weighs `candidates` on `devices` devices."""
        self._total = candidates
        self._say(f"{candidates} candidates on {devices} devices")
        self._refresh("tracing the step under each layout")

    def tracing(self, candidate: Candidate) -> None:
        """`candidate`'s layout is being traced (its bounds)."""
        self._refresh(f"tracing {_short(candidate)}")

    def compiling(self, candidate: Candidate) -> None:
        """`candidate` is being compiled (or found compiled)."""
        self._began = time.perf_counter()
        self._refresh(f"compiling {_short(candidate)}")

    def costed(self, row: PlanRow, reused: bool) -> None:
        """`row` was compiled (`reused`: found compiled) and costed."""
        took = time.perf_counter() - self._began
        self.reused += reused
        self.fresh += not reused
        self._decided.add(row.candidate)
        m = row.measured
        said = (
            f"peak {format_bytes(m.peak)}, step {m.seconds * 1e3:.3g} ms predicted"
            if m is not None
            else row.why
        )
        how = "reused" if reused else f"compiled in {took:.1f} s"
        self._say(f"{how}: {row.candidate.describe()}: {said}: {row.status}")
        self._refresh("")

    def settled(self, candidates: list[Candidate], status: str, why: str) -> None:
        """`candidates` were settled without compiling (`status`: pruned,
        bounded, skipped, or implied by the microbatch bisection)."""
        new = [c for c in candidates if c not in self._decided]
        self._decided.update(new)
        if status == "pruned":
            self.pruned += len(new)
        else:
            self.bounded += len(new)
        if new and status in ("pruned", "bounded", "skipped"):
            self._say(f"{status}: {new[0].describe()}: {why}")
        self._refresh("")

    def timing(self, candidate: Candidate) -> None:
        """`candidate`'s step is being run and timed."""
        self._refresh(f"timing {_short(candidate)}")

    def timed(self, candidate: Candidate, seconds: float | None, why: str) -> None:
        """`candidate`'s median step took `seconds` (None: it could not
        run, `why`)."""
        said = why if seconds is None else f"{seconds * 1e3:.3g} ms a step measured"
        self._say(f"timed: {candidate.describe()}: {said}")

    def _refresh(self, doing: str) -> None:
        if self._bar is None:
            return
        left = self._total - len(self._decided)
        reused = f" reused {self.reused}" if self.reused else ""
        counts = (
            f"compiled {self.fresh}{reused} pruned {self.pruned} bounded "
            f"{self.bounded} left {left}"
        )
        self._bar.update(
            self._task,
            total=self._total,
            completed=len(self._decided),
            counts=counts,
            description=doing,
        )

    def _say(self, line: str) -> None:
        """`line` on the log, where lines are shown."""
        if self._lines:
            logger.log(logging.INFO, "plan: %s", line, extra={MARK: True})


def _short(candidate: Candidate) -> str:
    """`candidate` as the bar has room for: its mesh (or strategy) as the
    table writes it, its microbatches and remat where it has them."""
    c = candidate
    text = c.sizes
    text += f" micro {c.microbatches}" if c.microbatches > 1 else ""
    text += " remat" if c.remat is not None and c.remat is not False else ""
    return text + (" offload" if c.offload else "")
