"""A run resumed in a new process logs what the run never stopped logs, to
the bit: every epoch's and every evaluation's metrics (evaluation sets that
shuffle included: their loaders' positions are checkpointed), both loggers'
files, and the whole state; and a run whose resumed part starts on its
pass's short last batch pads it as the pass did. The runs are
resume_script.py's: straight and stopped here, resumed by that script in a
process of its own, which says what it resumed in one line."""

import json
import pathlib
import runpy
import sys

import numpy as np
import pytest
from typing_extensions import override

import forkserver
import phalanx as px
from cli_runs import ENV, TIMEOUT, csv_rows, said, timing


SCRIPT = pathlib.Path(__file__).with_name("resume_script.py")
RUNS = runpy.run_path(str(SCRIPT))


class StopAt(px.Callback):
    def __init__(self, step: int):
        self.step = step

    @override
    def on_step_end(self, info):
        if info.step == self.step:
            info.stop()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path, str]:
    """The straight runs' folders, the resumed runs' and the resuming
    process's stderr."""
    straight = tmp_path_factory.mktemp("straight")
    stopped = tmp_path_factory.mktemp("stopped")
    for name, stop in (("logged", 10), ("ragged", 3)):
        train = RUNS[name]
        done = train(straight / name)
        np.savez(straight / name / "state.npz", **RUNS["host_state"](done))
        history = json.dumps(done.history.state_dict())
        (straight / name / "history.json").write_text(history)
        train(stopped / name, StopAt(stop))
    result = forkserver.run(
        [sys.executable, str(SCRIPT), str(stopped)],
        cwd=stopped,
        env=ENV,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    return straight, stopped, result.stderr


def logged_rows(run: pathlib.Path) -> list[dict]:
    return [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


def without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not timing(k)} for row in rows]


def same_state(a: pathlib.Path, b: pathlib.Path) -> bool:
    with np.load(a / "state.npz") as x, np.load(b / "state.npz") as y:
        return sorted(x) == sorted(y) and all(
            x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]) for k in x
        )


@pytest.mark.slow
def test_every_logged_value_is_the_straight_runs(resumed):
    straight, stopped = resumed[0] / "logged", resumed[1] / "logged"
    # Stopped where the call of steps 10 and 11 ended, saved at 11 (every 5
    # steps, acted on where a call ends): in the second epoch, after one
    # evaluation of each set.
    history = json.loads((stopped / "history.json").read_text())
    want = json.loads((straight / "history.json").read_text())
    assert [row["step"] for row in want["evaluations"]] == [7, 14, 21]
    assert {"eval_val_f1", "eval_train_auc", "f1", "auc"} <= set(want["epochs"][0])
    # JSON holds floats as repr: equal text is equal bits.
    assert [sorted(e) for e in history["epochs"]] == [sorted(e) for e in want["epochs"]]
    assert without_timings(history["epochs"]) == without_timings(want["epochs"])
    assert history["evaluations"] == want["evaluations"]
    # The same rows and names; the same values but the measured rates.
    rows, want_rows = logged_rows(stopped), logged_rows(straight)
    assert [sorted(row) for row in rows] == [sorted(row) for row in want_rows]
    assert "tflops_per_sec" in rows[-1]
    assert without_timings(rows) == without_timings(want_rows)
    header, cells = csv_rows(stopped)
    assert (header, cells) == csv_rows(straight)  # (csv_rows drops rates)
    assert same_state(stopped, straight)


@pytest.mark.slow
def test_a_resume_on_the_short_last_batch_is_exact(resumed):
    straight, stopped = resumed[0] / "ragged", resumed[1] / "ragged"
    assert same_state(stopped, straight)
    history = json.loads((stopped / "history.json").read_text())
    assert history == json.loads((straight / "history.json").read_text())


@pytest.mark.slow
def test_the_resuming_process_says_what_it_resumed(resumed):
    stopped = resumed[1]
    assert said(resumed[2]) == [
        f"phalanx: resumed from step 11 (epoch 2) of {stopped}/logged/checkpoints/11",
        f"phalanx: resumed from step 3 (epoch 1) of {stopped}/ragged/checkpoints/3",
    ]
