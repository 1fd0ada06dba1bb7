"""No orphans (issue 54, item 6): ``phalanx train --data-workers 2`` on a
records folder, SIGKILLed at an epoch's end just as the evaluation pass's
grain workers start (before they finish starting up), leaves no process
behind: the training pass's and the evaluation pass's workers and
multiprocessing's resource tracker all end, as read from the process table.
"""

import os
import pathlib
import signal
import time

import pytest

import phalanx as px
from cli_runs import Phalanx


ENDED_WITHIN = 60.0  # seconds; here they take 2-8 (a worker's start-up first)


def _processes() -> dict[int, tuple[int, str]]:
    """Every process in the table: its parent's pid and its state (``Z``: a
    zombie, ended but not yet reaped), read from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # ended as the table was read
                continue
            # "pid (name) state ppid ...": a name may hold spaces and parens.
            state, parent = stat[stat.rindex(")") + 2 :].split()[:2]
            table[int(entry)] = (int(parent), state)
    return table


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    return [child for child, (parent, _) in _processes().items() if parent == pid]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_run_killed_at_an_epochs_end_leaves_no_process_behind(tmp_path):
    (x, y), (x_test, y_test) = px.data.load_digits()
    # An epoch of 1 step: its end comes soon.
    px.data.write_records(tmp_path, "train", [(x[:256], y[:256])])
    px.data.write_records(tmp_path, "test", [(x_test, y_test)])
    run = Phalanx(
        tmp_path,
        *("--dataset", f"records:{tmp_path}", "--data-workers", "2"),
        *("--epochs", "2", "--batch-size", "256", "--no-plot", "--devices", "1"),
        *("--run-dir", str(tmp_path / "run")),
    )
    pid = run.process.pid
    deadline = time.monotonic() + 120
    # The training pass's 2 workers, then at epoch 1's end the evaluation
    # pass's 2 (and the resource tracker).
    while sum("spawn_main" in _cmdline(c) for c in _children(pid)) < 4:
        assert run.process.poll() is None, run.output()
        assert time.monotonic() < deadline, run.output()
        time.sleep(0.02)
    children = _children(pid)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + ENDED_WITHIN
    alive = children
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        table = _processes()
        alive = [c for c in children if c in table and table[c][1] != "Z"]
    survivors = {c: _cmdline(c) for c in alive}
    for child in alive:  # this test's own processes: do not leave them running
        os.kill(child, signal.SIGKILL)
    assert not survivors, survivors
    run.wait()  # (its output pipe closes as the last worker ends)
    assert len(children) >= 4, children  # 4 workers (and the resource tracker)
