"""Issue 41, items 3 and 4: the Timeline names the callbacks that took the
time; PlotHistory draws within its share of the fit's time, off the
training thread; a killed fit's timeline survives to the resume (in the
checkpoint, and in the file written while it ran), and ``steps_again``
counts the steps the kill lost."""

import json
import threading
import time
import types

import jax
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model
from phalanx.callbacks import _budget, _timeline
from phalanx.callbacks._budget import TimeBudget


def batches(n: int, size: int = 16) -> list:
    x, y = make_data(n * size)
    return [(x[i : i + size], y[i : i + size]) for i in range(0, n * size, size)]


class Sleepy(px.Callback):
    """Sleeps `seconds` at each epoch end, and compiles a new function once."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.compiled = False

    @override
    def on_epoch_end(self, info: px.StepInfo) -> None:
        time.sleep(self.seconds)
        if not self.compiled:
            self.compiled = True
            jax.jit(lambda v: v * 3 + 1)(jax.numpy.ones(7)).block_until_ready()


def test_each_callbacks_seconds_are_named(tmp_path, capsys):
    timeline = px.callbacks.Timeline(tmp_path / "t.json")
    sleepy, other = Sleepy(0.05), Sleepy(0.0)
    other.state_name = "other"  # two of a class: told apart by state_name
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        callbacks=[timeline, sleepy, other],
        progress=False,
    )
    trainer.fit(batches(4), epochs=3)
    record = json.loads((tmp_path / "t.json").read_text())
    seconds = record["callbacks"]
    assert set(seconds) == {"Timeline", "Sleepy", "Sleepy:other"}
    assert 0.15 <= seconds["Sleepy"] < record["phases"]["callbacks"] + 1e-9
    assert seconds["Sleepy:other"] < 0.05
    # Every callback here counts as "callbacks": their seconds are that phase.
    assert sum(seconds.values()) == pytest.approx(record["phases"]["callbacks"])
    # A compile inside a hook is named by its callback, and is not its time.
    names = [c["name"] for c in record["compiles"]]
    assert "Sleepy: jit(<lambda>)" in names and "Sleepy:other: jit(<lambda>)" in names
    # The table names the callback that took the time.
    assert "callback: Sleepy" in capsys.readouterr().out


def test_plot_draws_within_its_share_off_the_training_thread(tmp_path, monkeypatch):
    threads = []
    real = px.callbacks.PlotHistory._draw_names

    def draw(self, history, names):
        threads.append((threading.current_thread(), len(history)))
        real(self, history, names)

    monkeypatch.setattr(px.callbacks.PlotHistory, "_draw_names", draw)
    plot = px.callbacks.PlotHistory(tmp_path / "h.png")  # 2%: first wait 25 s
    every = px.callbacks.PlotHistory(tmp_path / "e.png", metrics=["loss"], max_share=1)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[plot, every], progress=False
    )
    trainer.fit(batches(2), epochs=4)
    plot.wait()
    every.wait()
    assert all(thread is not threading.main_thread() for thread, _ in threads)
    drawn = sorted(size for _, size in threads)
    # The default plot: once, at the fit's end; max_share=1: every epoch end
    # (the fit's end finds the history drawn already).
    assert drawn == [1, 2, 3, 4, 4]
    assert (tmp_path / "h.png").stat().st_size > 0


def test_a_time_budget_waits_for_its_share(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    budget = TimeBudget(0.02, first=0.5, floor=1.0)
    budget.restart()
    now[0] += 24.9
    assert not budget.due()  # 0.5 s ÷ 2%: 25 s
    now[0] += 0.1
    assert budget.due()
    with budget.spend():
        now[0] += 0.01  # a drawing of 10 ms: the wait is the floor's 1 s
    now[0] += 0.99
    assert not budget.due()
    now[0] += 0.01
    assert budget.due()
    assert TimeBudget(1.0, first=9.0).due()  # share 1: whenever asked


class Killed(BaseException):
    """Ends the fit as a SIGKILL would: no hook's on_exception runs after it."""


def test_a_killed_fits_timeline_survives_to_the_resume(tmp_path, monkeypatch):
    path = tmp_path / "timeline.json"

    def run(*callbacks: px.Callback, keep_earlier: bool = True):
        timeline = px.callbacks.Timeline(path, table=False, keep_earlier=keep_earlier)
        timeline._writes.share = 1  # written at each call's end
        checkpoint = px.callbacks.Checkpoint(tmp_path / "ckpt", every_n_steps=5)
        trainer = px.DataParallelTrainer(
            make_model(),
            optax.adam(1e-2),
            callbacks=[timeline, *callbacks, checkpoint],
            progress=False,
        )
        return trainer, timeline

    class Kill(px.Callback):  # after the Timeline: the file holds step 13
        @override
        def on_step_end(self, info: px.StepInfo) -> None:
            if info.step == 13:
                raise Killed

    # A kill leaves no time for hooks: the Timeline's last word is its file.
    monkeypatch.setattr(px.callbacks.Timeline, "on_exception", lambda *a: None)
    trainer, _ = run(Kill())
    with pytest.raises(Killed):
        trainer.fit(batches(20), epochs=1)
    killed = json.loads(path.read_text())
    assert (killed["first_step"], killed["last_step"], killed["ended"]) == (0, 13, None)
    monkeypatch.undo()

    # Resumed from step 10: the fit before it is the killed one, as far as
    # its file got, and the 3 steps past the checkpoint count as lost.
    trainer, timeline = run()
    trainer.fit(batches(20), epochs=1, resume="latest")
    record = json.loads(path.read_text())
    (before,) = record["earlier"]
    assert before["started"] == killed["started"]
    assert (before["last_step"], before["wall_s"]) == (13, killed["wall_s"])
    assert (record["first_step"], record["last_step"]) == (10, 20)
    assert record["total"]["steps_again"] == 3
    assert record["total"]["fits"] == 2
    assert record["ended"] == "returned"

    # Without the file (keep_earlier=False): the checkpoint keeps the killed
    # fit up to its step, so its part of the run is still counted.
    path.unlink()
    trainer, timeline = run(keep_earlier=False)
    trainer.fit(batches(20), epochs=1, resume=tmp_path / "ckpt" / "10")
    (before,) = timeline.record()["earlier"]
    assert before["started"] == killed["started"]
    assert (before["first_step"], before["last_step"]) == (0, 10)
    assert 0 < before["wall_s"] <= killed["wall_s"]
    assert timeline.record()["total"]["steps_again"] == 0


def test_the_file_is_written_while_the_fit_runs(tmp_path, monkeypatch):
    # The write budget's clock is the test's: it moves only when the callback
    # below says time passed, so the writes do not depend on how long a step
    # takes on a busy machine (with a real clock, a step slowed past the
    # floor wrote the record one step later than the test expected).
    now = [0.0]
    monkeypatch.setattr(
        _budget, "time", types.SimpleNamespace(perf_counter=lambda: now[0])
    )
    path = tmp_path / "t.json"
    seen = {}

    class Look(px.Callback):  # after the Timeline, at each epoch's end
        @override
        def on_epoch_end(self, info: px.StepInfo) -> None:
            now[0] += _timeline._WRITE_EVERY_S  # the floor between writes
            seen[info.step] = json.loads(path.read_text()) if path.exists() else None

    timeline = px.callbacks.Timeline(path, table=False)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[timeline, Look()], progress=False
    )
    trainer.fit(batches(3), epochs=3)
    # Nothing is written before the floor has passed; then the next step's
    # end writes the record so far (step 4, then step 7), and the epoch's
    # end, less than the floor after it, does not.
    assert seen[3] is None
    assert (seen[6]["last_step"], len(seen[6]["epochs"])) == (4, 1)
    assert (seen[9]["last_step"], len(seen[9]["epochs"])) == (7, 2)
    assert seen[6]["ended"] is None and seen[9]["ended"] is None
    final = json.loads(path.read_text())
    assert (final["last_step"], final["ended"]) == (9, "returned")
