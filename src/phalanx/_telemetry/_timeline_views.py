"""How `px.callbacks.Timeline` shows a timeline: the table it prints (the
phases, the callbacks that took the time, the compiles) and the Chrome
trace events of the phases. It reads a record or a clock; it writes nothing.
"""

from typing import Any

from rich.table import Table

from ._clock import PHASE_MEANINGS, PhaseClock


# The callbacks, and the compiles, the table shows at most (the longest).
_SHOWN = 5


def timeline_table(record: dict[str, Any]) -> Table:
    """The table `Timeline` prints: each phase's seconds and share of the
    wall time, then each callback's (the time of its hooks, in whichever
    phase it counts), then the compiles; and, where it keeps earlier fits,
    their sums."""
    wall = record["wall_s"]
    table = Table(
        title=f"where the time went: {wall:.2f} s, goodput {record['goodput']:.0%}",
        title_justify="left",
    )
    run = record.get("total")
    if run is not None and run["fits"] > 1:
        table.caption = (
            f"with the {run['fits'] - 1} earlier fit(s) kept: {run['wall_s']:.2f} s, "
            f"goodput {run['goodput']:.0%}, {run['steps_again']} step(s) "
            "computed again after a resume"
        )
        table.caption_justify = "left"
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    table.add_column("what it is")
    for phase, seconds in record["phases"].items():
        share = seconds / wall if wall > 0 else 0.0
        table.add_row(phase, f"{seconds:.3f}", f"{share:.1%}", PHASE_MEANINGS[phase])
    callbacks = sorted(record.get("callbacks", {}).items(), key=lambda kv: -kv[1])
    for name, seconds in callbacks[:_SHOWN]:
        share = seconds / wall if wall > 0 else 0.0
        table.add_row("", f"{seconds:.3f}", f"{share:.1%}", f"callback: {name}")
    if len(callbacks) > _SHOWN:
        table.add_row("", "", "", f"... {len(callbacks)} callbacks in all")
    compiles = record["compiles"]
    for each in sorted(compiles, key=lambda c: -c["seconds"])[:_SHOWN]:
        table.add_row("", f"{each['seconds']:.3f}", "", f"compile: {each['name']}")
    if len(compiles) > _SHOWN:
        table.add_row("", "", "", f"... {len(compiles)} compiles in all")
    return table


def trace_events(clock: PhaseClock) -> dict[str, Any]:
    """The phases (track 1) and the compiles (track 2) as Chrome trace
    events ("X": complete events, microseconds from the clock's start)."""
    start = clock.start
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "fit"}},
        {
            "ph": "M",
            "pid": 1,
            "tid": 2,
            "name": "thread_name",
            "args": {"name": "compiles"},
        },
    ]
    for phase, begin, end in clock.segments or ():
        events.append(_event(phase, begin - start, end - begin, 1))
    for each in clock.compiles:
        events.append(_event(each.name, each.at - each.seconds, each.seconds, 2))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"dropped_phase_changes": clock.dropped},
    }


def _event(name: str, at: float, seconds: float, track: int) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "pid": 1,
        "tid": track,
        "ts": round(at * 1e6, 1),
        "dur": round(seconds * 1e6, 1),
    }
