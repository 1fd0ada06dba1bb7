"""Issue 33, part 2: where a fit's time goes (the phase clock and
`px.callbacks.Timeline`): the parts sum to the wall time, compiles are
counted and named, and measuring adds no wait for the device."""

import itertools
import json
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import count_host_waits, make_data, make_model


PHASES = ("step", "compile", "data", "host", "eval", "checkpoint", "callbacks")


def batches(n: int, size: int = 16) -> list:
    x, y = make_data(n * size)
    return [(x[i : i + size], y[i : i + size]) for i in range(0, n * size, size)]


def test_parts_sum_to_the_wall_time(tmp_path):
    data = batches(12)
    timeline = px.callbacks.Timeline(
        path=tmp_path / "timeline.json", trace=tmp_path / "trace.json", table=False
    )
    saves = px.callbacks.Checkpoint(tmp_path / "ckpt", every_n_steps=5)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(2),
        callbacks=[timeline, saves],
        sync_every=4,
        progress=False,
    )
    start = time.perf_counter()
    trainer.fit(data, epochs=2, eval_data=data[:3])
    wall = time.perf_counter() - start
    record = json.loads((tmp_path / "timeline.json").read_text())
    parts = record["phases"]
    assert sum(parts.values()) == pytest_approx(record["wall_s"])
    assert abs(record["wall_s"] - wall) <= 0.05 * wall
    for phase in PHASES:  # each measured, none negative
        assert parts[phase] > 0, phase
    assert min(parts.values()) >= 0
    # Per epoch: time/<phase> and goodput in the history, summing to the epoch.
    epoch = trainer.history[-1]
    assert 0 < epoch["goodput"] < 1
    row = record["epochs"][-1]
    assert sum(row[p] for p in parts) == pytest_approx(row["wall"])
    assert epoch["time/step"] == row["step"]
    # PlotHistory's default panels leave the phases out (goodput is one).
    names = px.callbacks.PlotHistory(tmp_path / "h.png")._names(trainer.history)
    assert "goodput" in names and not any(n.startswith("time/") for n in names)
    # The trace: Chrome "X" events of the phases, back to back.
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X" and e["tid"] == 1]
    assert {e["name"] for e in spans} >= {"step", "data", "host", "checkpoint"}
    # From the Timeline's on_fit_start (the fit's set-up before it is not
    # recorded: 5-9% of this short fit) to the last phase change.
    for before, after in itertools.pairwise(spans):
        assert after["ts"] == pytest.approx(before["ts"] + before["dur"], abs=2)
    covered = sum(e["dur"] for e in spans) / 1e6
    assert 0.5 * record["wall_s"] <= covered <= record["wall_s"]


def pytest_approx(value):
    return pytest.approx(value, rel=1e-6, abs=1e-6)


class LowerRate(px.Callback):
    """Replaces the learning rate at `step` with a weakly typed array (a
    Python number's)."""

    def __init__(self, steps: tuple[int, ...], names: tuple[str, ...]):
        self.changes = dict(zip(steps, names, strict=True))

    @override
    def on_step_end(self, info):
        name = self.changes.get(info.step)
        if name is not None:
            state = info.state
            hyperparams = state.opt_state
            assert isinstance(hyperparams, optax.InjectStatefulHyperparamsState)
            info.trainer.state = eqx.tree_at(
                lambda s: s.opt_state.hyperparams[name],
                state,
                jnp.asarray(0.5 * float(np.asarray(hyperparams.hyperparams[name]))),
            )


def test_keep_earlier_keeps_the_fits_the_file_holds(tmp_path, caplog):
    path = tmp_path / "timeline.json"
    path.write_text("not json")  # a file that is no timeline: said, replaced

    def fit(steps: int) -> dict:
        timeline = px.callbacks.Timeline(path, table=False, keep_earlier=True)
        trainer.callbacks = [timeline]
        trainer.fit(batches(steps))
        return json.loads(path.read_text())

    trainer = px.DataParallelTrainer(
        make_model(), optax.sgd(1e-2), strategy=px.ShardingStrategy(1), progress=False
    )
    first = fit(3)
    assert "holds no timeline" in caplog.text
    assert first["earlier"] == []
    assert (first["first_step"], first["last_step"]) == (0, 3)
    assert first["total"]["fits"] == 1
    second = fit(4)  # the same trainer goes on: steps 3 to 7
    (kept,) = second["earlier"]
    assert kept == {k: v for k, v in first.items() if k not in ("earlier", "total")}
    assert (second["first_step"], second["last_step"]) == (3, 7)
    run = second["total"]
    assert run["fits"] == 2 and run["steps_again"] == 0
    assert run["wall_s"] == pytest_approx(first["wall_s"] + second["wall_s"])
    assert run["phases"]["step"] == pytest_approx(
        first["phases"]["step"] + second["phases"]["step"]
    )
    assert run["goodput"] == pytest_approx(run["phases"]["step"] / run["wall_s"])
    table = px.callbacks._timeline.timeline_table(second)
    assert "with the 1 earlier fit(s) kept" in str(table.caption)


def test_steps_computed_again_after_a_resume_are_counted():
    def fit(first: int, last: int | None) -> dict:
        return {"wall_s": 1.0, "phases": {"step": 0.5},
                "first_step": first, "last_step": last}  # fmt: skip

    # Stopped at 30, resumed from the checkpoint at 23; stopped at 40 with
    # no end recorded, resumed at 40; then at 50 from 45.
    fits = [fit(0, 30), fit(23, None), fit(40, 50), fit(45, 60)]
    run = px.callbacks._timeline.total(fits[:-1], fits[-1])
    assert run["steps_again"] == 7 + 5
    assert run["fits"] == 4 and run["goodput"] == 0.5


def test_a_second_compile_is_counted_and_named():
    # A pass of another batch size is a new signature: a program of its
    # own, built (and compiled) by the loop before its first step.
    class TwoSizes:
        passes = 0

        def __len__(self):
            return 3

        def __iter__(self):
            self.passes += 1
            return iter(batches(3, size=16 if self.passes == 1 else 8))

    data = TwoSizes()
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(1),
        progress=False,
    )
    trainer.fit(data, epochs=2)
    clock = trainer._parts.current.clock
    assert clock is not None
    train = [c for c in clock.compiles if c.name.startswith("train step")]
    assert [c.name for c in train] == [
        "train step, batch f32[16,5] i32[16]",
        "train step, batch f32[8,5] i32[8]",
    ]
    assert all(c.seconds > 0 for c in train)
    totals = clock.totals()
    assert totals["compile"] >= sum(c.seconds for c in clock.compiles) * 0.99
    assert train[1].at > train[0].at


def test_a_weakly_typed_state_leaf_compiles_nothing_more():
    # The compiled step takes a weakly typed leaf for its strong type (the
    # same bits): a callback that sets one costs no compile.
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
        strategy=px.ShardingStrategy(1),
        callbacks=[LowerRate((3,), ("learning_rate",))],
        progress=False,
    )
    trainer.fit(batches(6), epochs=1)
    clock = trainer._parts.current.clock
    assert clock is not None
    train = [c for c in clock.compiles if c.name.startswith("train step")]
    assert [c.name for c in train] == ["train step, batch f32[16,5] i32[16]"]
    learning_rate = trainer.state.opt_state.hyperparams["learning_rate"]  # pyright: ignore[reportAttributeAccessIssue]
    assert float(learning_rate) == pytest.approx(5e-3)


def test_no_wait_for_the_device_is_added(monkeypatch):
    x, y = make_data(32)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(2),
        sync_every=8,
        callbacks=[px.callbacks.Timeline(table=False)],
        progress=False,
    )
    trainer.fit([(x, y)], steps=2)  # compile outside the counted run
    fetches = count_host_waits(monkeypatch)
    with jax.transfer_guard_device_to_host("disallow"):
        trainer.fit([(x, y)] * 32, epochs=1)
    # As tests/engine/test_loop.py counts without a Timeline: the loop's own.
    assert len(fetches) == 32 // 8 - 1 + 1
    assert trainer.history[-1]["time/step"] > 0


def test_a_callback_declares_its_phase():
    class Bad(px.Callback):
        time_phase = "thinking"  # pyright: ignore[reportAssignmentType]

    try:
        px.DataParallelTrainer(make_model(), optax.adam(1e-2), callbacks=[Bad()])
    except ValueError as error:
        assert "time_phase='thinking'" in str(error)
        assert "checkpoint" in str(error)
    else:
        raise AssertionError("no error")
