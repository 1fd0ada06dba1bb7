"""The Profiler callback: the trace files it writes hold the steps asked for."""

import gzip
import json
import pathlib
import re

import jax
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model
from phalanx.callbacks import Profiler


STEPS_PER_EPOCH = 6
# XLA:CPU's event for one run of a compiled program on device 0.
DEVICE_0_RUN = re.compile(r"^\[0\] .*Execute\b")
# The same, of a train step's program only (one step's or several's: the
# function `_sums_apart` jits is named `call`); a trace begun at a fit's
# start also holds the epoch's set-up (its sums zeroed).
TRAIN_RUN = re.compile(r"^\[0\] .*Execute \(jit_call\)")


def batches() -> list:
    x, y = make_data(STEPS_PER_EPOCH * 16)
    return [(x[i : i + 16], y[i : i + 16]) for i in range(0, len(x), 16)]


def make_trainer(*callbacks: px.Callback, steps_per_call: int = 1):
    return px.DataParallelTrainer(
        make_model(),
        optax.sgd(0.1),
        strategy=px.ShardingStrategy(8),
        callbacks=callbacks,
        steps_per_call=steps_per_call,
    )


def traced_calls(logdir: pathlib.Path, runs: re.Pattern = DEVICE_0_RUN) -> list[int]:
    """For each trace under `logdir`: the compiled calls run on device 0 in
    it (those `runs` matches). Each trace's files must be there, non-empty
    and readable."""
    calls = []
    for folder in sorted((logdir / "plugins" / "profile").iterdir()):
        (xplane,) = folder.glob("*.xplane.pb")
        assert xplane.stat().st_size > 0
        (perfetto,) = folder.glob("perfetto_trace.json.gz")
        with gzip.open(perfetto) as file:
            events = json.load(file)["traceEvents"]
        calls.append(sum(bool(runs.match(e.get("name", ""))) for e in events))
    return calls


def assert_no_trace_running(tmp_path: pathlib.Path) -> None:
    # JAX refuses to start a trace while another one runs.
    jax.profiler.start_trace(tmp_path / "probe")
    jax.profiler.stop_trace()


def test_the_trace_holds_the_steps_of_its_range(tmp_path):
    trainer = make_trainer(Profiler(tmp_path, steps=(3, 5)))
    trainer.fit(batches(), epochs=1)
    assert traced_calls(tmp_path) == [3]  # steps 3, 4 and 5, one call each
    assert_no_trace_running(tmp_path)


def test_with_steps_per_call_the_trace_holds_whole_calls(tmp_path, capsys):
    # Calls make steps 1-2, 3-4, 5-6: steps 3 and 4 are the second call.
    trainer = make_trainer(Profiler(tmp_path, steps=(3, 4)), steps_per_call=2)
    trainer.fit(batches(), epochs=1)
    assert traced_calls(tmp_path) == [1]
    assert "Profiler" not in capsys.readouterr().err  # nothing missed


def profiler_lines(capsys) -> list[str]:
    return [
        line for line in capsys.readouterr().err.splitlines() if "Profiler(" in line
    ]


def test_a_range_inside_the_first_call_traces_that_call(tmp_path, capsys):
    # The first call makes steps 1-4: traced from the fit's start.
    trainer = make_trainer(Profiler(tmp_path, steps=(2, 3)), steps_per_call=4)
    trainer.fit(batches(), epochs=2)
    assert traced_calls(tmp_path, TRAIN_RUN) == [1]  # that one call, no other
    assert profiler_lines(capsys) == []


def test_a_range_begun_inside_the_first_call_is_traced_whole(tmp_path, capsys):
    # Calls: steps 1-4 (fused), then 5 and 6 one by one, reported together
    # (the pass's end): the trace holds the whole of each.
    trainer = make_trainer(Profiler(tmp_path, steps=(2, 5)), steps_per_call=4)
    trainer.fit(batches(), epochs=1)
    assert traced_calls(tmp_path, TRAIN_RUN) == [3]
    assert profiler_lines(capsys) == []


def test_a_later_range_under_steps_per_call_begins_after_a_call(tmp_path):
    # Calls of 3: steps 1-3, 4-6, then (epoch 2) 7-9, 10-12; steps 8 and 9
    # are in the third call, which the trace holds alone.
    trainer = make_trainer(Profiler(tmp_path, steps=(8, 9)), steps_per_call=3)
    trainer.fit(batches(), epochs=2)
    assert traced_calls(tmp_path) == [1]


def test_a_fit_that_ends_inside_the_range_writes_its_trace(tmp_path):
    trainer = make_trainer(Profiler(tmp_path, steps=(2, 100)))
    trainer.fit(batches(), steps=4)
    assert traced_calls(tmp_path) == [3]  # steps 2 to 4
    assert_no_trace_running(tmp_path)


def test_a_fit_that_raises_inside_the_range_writes_its_trace(tmp_path):
    class Fail(px.Callback):
        @override
        def on_step_end(self, info: px.StepInfo) -> None:
            if info.step == 3:
                raise KeyError("boom")

    trainer = make_trainer(Profiler(tmp_path, steps=(2, 5)), Fail())
    with pytest.raises(KeyError, match="boom"):
        trainer.fit(batches(), epochs=1)
    assert traced_calls(tmp_path) == [2]  # steps 2 and 3
    assert_no_trace_running(tmp_path)


def test_a_run_resumed_inside_the_range_is_traced_from_its_first_step(tmp_path):
    trainer = make_trainer()
    trainer.fit(batches(), steps=4)
    trainer.callbacks = [Profiler(tmp_path, steps=(2, 5))]
    trainer.fit(batches(), steps=2)  # steps 5 and 6
    assert traced_calls(tmp_path) == [1]


def test_a_second_trace_at_once_is_refused_with_a_warning(tmp_path):
    first = Profiler(tmp_path / "a", steps=(2, 3))
    second = Profiler(tmp_path / "b", steps=(2, 3))
    trainer = make_trainer(first, second)
    with pytest.warns(RuntimeWarning, match="records no trace.*Only one profile"):
        trainer.fit(batches(), steps=4)
    assert traced_calls(tmp_path / "a") == [2]
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "steps, error",
    [
        ((0, 5), ValueError),
        ((5, 4), ValueError),
        ((-1, 5), ValueError),
        (10, TypeError),
        ("10", TypeError),
        ((1, 2, 3), TypeError),
        ((1.0, 2), TypeError),
        ((True, 2), TypeError),
        (None, TypeError),
    ],
)
def test_bad_steps_are_refused_with_the_fix(tmp_path, steps, error):
    with pytest.raises(
        error, match=re.escape(f"steps={steps!r}") + ".*steps=\\(10, 20\\)"
    ):
        Profiler(tmp_path, steps=steps)


def test_one_step_and_lists_are_accepted(tmp_path):
    profiler = Profiler(tmp_path, steps=[7, 7])  # pyright: ignore[reportArgumentType]
    assert (profiler.start, profiler.end) == (7, 7)


def test_a_bad_logdir_is_refused(tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    with pytest.raises(NotADirectoryError, match="logdir="):
        Profiler(file)
    with pytest.raises(TypeError, match="logdir=3"):
        Profiler(3)  # pyright: ignore[reportArgumentType]
