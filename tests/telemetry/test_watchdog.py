"""The hang watchdog in one process (issue 45, item 5): a callback that
stalls past ``hang_timeout`` is dumped (its phase, its stack) and the
process would end with code 75 (`os._exit` is caught here); the thread
ends with the fit; bad deadlines are refused when the trainer is built; a
dump of another process makes this one dump too. The 2-process runs are in
tests/strategies/test_recover.py."""

import math
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model
from phalanx._telemetry._clock import PhaseClock
from phalanx._telemetry._watchdog import HANG_EXIT_CODE, HangWatchdog, resolve_auto


WATCHDOG = "phalanx-hang-watchdog"


class Stall(px.Callback):
    """Sleeps `seconds` at the end of step `at`; notes the threads running
    at step 1."""

    def __init__(self, at: int, seconds: float):
        self.at, self.seconds = at, seconds
        self.threads: list[str] = []

    @override
    def on_step_end(self, info):
        if info.step == 1:
            self.threads = [thread.name for thread in threading.enumerate()]
        if info.step == self.at:
            time.sleep(self.seconds)


@pytest.fixture
def exits(monkeypatch) -> list[int]:
    """The codes `os._exit` was called with (the watchdog's thread ends
    instead of the process)."""
    codes: list[int] = []
    monkeypatch.setattr(os, "_exit", codes.append)
    return codes


def fit(stall: Stall, hang_timeout) -> None:
    x, y = make_data(64)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.sgd(0.1),
        strategy=px.ShardingStrategy(1),
        progress=False,
        callbacks=[stall],
        hang_timeout=hang_timeout,
        slow_steps=None,
    )
    trainer.fit([(x, y)] * 4, epochs=1)


def test_a_stalled_callback_is_dumped_and_ends_the_process(
    tmp_path, monkeypatch, exits
):
    monkeypatch.chdir(tmp_path)  # no Checkpoint: the dump goes to ./phalanx-hang
    stall = Stall(at=2, seconds=2.0)
    fit(stall, hang_timeout=1)
    assert exits == [HANG_EXIT_CODE]
    dump = (tmp_path / "phalanx-hang" / "hang-rank0.txt").read_text()
    head = dump.split("\n\n")[0].splitlines()
    assert head[0].startswith("phalanx hang watchdog: no progress for ")
    assert "rank: 0 of 1" in head and "step: 2" in head
    assert "phase: callbacks (Stall)" in head
    assert "deadline: 1.0 s (hang_timeout=1)" in head
    # Every thread's stack, the fit's among them, stopped in the callback.
    fit_thread = next(line for line in head if line.startswith("fit thread: "))
    ident = fit_thread.split()[2]
    stack = dump.split(f"Thread {ident} (most recent call first):\n")[1]
    assert stack.splitlines()[0].endswith("in on_step_end")
    # The watchdog ran beside the fit and ended with it.
    assert WATCHDOG in stall.threads
    assert WATCHDOG not in [thread.name for thread in threading.enumerate()]


def test_a_fit_that_keeps_going_is_left_alone(tmp_path, monkeypatch, exits):
    monkeypatch.chdir(tmp_path)
    stall = Stall(at=2, seconds=0.2)  # shorter than the deadline
    fit(stall, hang_timeout=5)
    assert exits == [] and not (tmp_path / "phalanx-hang").exists()
    assert WATCHDOG in stall.threads
    assert WATCHDOG not in [thread.name for thread in threading.enumerate()]


@pytest.mark.parametrize("timeout", ["auto", None])
def test_off_in_interactive_sessions_unless_asked_and_off_when_none(
    tmp_path, monkeypatch, exits, timeout
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)  # as in `python -i`
    stall = Stall(at=99, seconds=0)
    fit(stall, hang_timeout=timeout)
    assert WATCHDOG not in stall.threads


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0, ValueError),
        (0.001, ValueError),  # shorter than a healthy first step's callbacks
        (-5, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        ("soon", TypeError),
        (True, TypeError),
    ],
)
def test_bad_deadlines_are_refused_when_the_trainer_is_built(value, error):
    with pytest.raises(error, match=rf"^hang_timeout={value!r}: pass .*or None to"):
        px.DataParallelTrainer(make_model(), optax.sgd(0.1), hang_timeout=value)


def watchdog(folder, timeout, processes=1) -> HangWatchdog:
    return HangWatchdog(
        PhaseClock(),
        lambda: 0,
        timeout=timeout,
        sync_every=16,
        folder=folder,
        rank=0,
        processes=processes,
    )


def test_auto_is_five_minutes_or_three_sync_windows_of_the_median_step(tmp_path):
    auto = watchdog(tmp_path, "auto")
    assert auto.deadline() == 300
    auto._seconds_per_step.extend([1.0] * 10)
    assert auto.deadline() == 300  # 3 × 16 × 1 s is less
    auto._seconds_per_step.extend([10.0] * 11)
    assert auto.deadline() == 3 * 16 * 10.0


def test_another_process_dump_makes_this_one_dump(tmp_path, exits):
    peer = tmp_path / "hang-rank1.txt"
    peer.write_text("an earlier run's dump")  # there before: not news
    with watchdog(tmp_path, 60.0, processes=2) as dog:
        time.sleep(1.5)
        assert exits == []
        peer.write_text("rank 1 hung")
        os.utime(peer, ns=(time.time_ns(), time.time_ns() + 10**9))
        give_up = time.monotonic() + 10
        while not exits and time.monotonic() < give_up:
            time.sleep(0.1)
    assert exits == [HANG_EXIT_CODE]
    first = dog.path.read_text().splitlines()[0]
    assert first.startswith("phalanx hang watchdog: hang-rank1.txt was written")


def test_auto_follows_the_launchers_environment(monkeypatch):
    monkeypatch.delenv("PHALANX_HANG_TIMEOUT", raising=False)
    assert resolve_auto("auto") == "auto"
    monkeypatch.setenv("PHALANX_HANG_TIMEOUT", "90")  # phalanx launch --hang-timeout
    assert resolve_auto("auto") == 90.0
    assert resolve_auto(5.0) == 5.0 and resolve_auto(None) is None  # asked: kept
    monkeypatch.setenv("PHALANX_HANG_TIMEOUT", "off")
    assert resolve_auto("auto") is None
    for bad in ("soon", "0.001"):
        monkeypatch.setenv("PHALANX_HANG_TIMEOUT", bad)
        with pytest.raises(ValueError) as error:
            resolve_auto("auto")
        assert str(error.value) == (
            f"PHALANX_HANG_TIMEOUT={bad!r}: set it to a number of seconds, at "
            "least 1 (e.g. 600), or off, or unset it"
        )


def test_a_long_compile_is_not_a_hang(tmp_path, exits):
    def wide(x):  # ~1.5 s to trace, lower and compile here (not deep: XLA's
        # passes recurse, and a chain of thousands of ops overflows its stack)
        parts = [jnp.sin(x + i) * jnp.cos(x - i) for i in range(1500)]
        return jnp.stack(parts).sum(0)

    with watchdog(tmp_path, 0.5):
        start = time.perf_counter()
        jax.jit(wide).lower(jnp.ones(8)).compile()
        took = time.perf_counter() - start
    assert took > 1.0, "the compile must outlast the deadline for this test"
    assert exits == [] and not (tmp_path / "hang-rank0.txt").exists()
