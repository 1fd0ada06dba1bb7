"""``phalanx train --dataset records:DIR`` (issue 45, item 2): ArrayRecord
splits read from disk through `px.data.GrainLoader` as the run goes, with
grain worker processes; a run SIGKILLed mid-epoch and resumed ends where a
straight run ends (the same history and final checkpoint, to the bit); a
folder without the splits, or of per-token labels, is refused in one line.

(The ≥ 1 GiB run and its resident memory: examples/digits_on_disk.py and the
data guide.)"""

import pathlib
import signal

import numpy as np
import pytest

import phalanx as px
from cli_runs import Phalanx, finish, host_state, listed, refused


ARGS = ["--epochs", "2", "--log-every", "5", "--no-plot", "--checkpoint-every", "5"]
ARGS += ["--data-workers", "2", "--batch-size", "128"]


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> pathlib.Path:
    """The digits as ArrayRecord splits (12 steps an epoch at batch 128)."""
    folder = tmp_path_factory.mktemp("records")
    (x, y), (x_test, y_test) = px.data.load_digits()
    px.data.write_records(folder, "train", [(x[:700], y[:700]), (x[700:], y[700:])])
    px.data.write_records(folder, "test", [(x_test, y_test)])
    return folder


@pytest.mark.slow
def test_a_killed_run_on_disk_data_resumes_exactly(records, tmp_path):
    dataset = ["--dataset", f"records:{records}"]
    straight = tmp_path / "straight"
    finish(tmp_path, *dataset, *ARGS, "--run-dir", str(straight))
    killed = tmp_path / "killed"
    run = Phalanx(tmp_path, *dataset, *ARGS, "--run-dir", str(killed))
    # Mid-epoch 1 (12 steps an epoch): step 15's checkpoint is on disk (its
    # folder appears whole, by a rename; listing the folder with orbax while
    # the run deletes older steps races with it).
    step_15 = killed / "checkpoints" / "15"
    run.signal_when(lambda r: step_15.is_dir(), signal.SIGKILL)
    resumed = finish(tmp_path, *dataset, *ARGS, "--run-dir", str(killed), "--resume")
    assert "resumed from step" in resumed.stderr + "\n".join(resumed.lines)
    steps, last = listed(straight / "checkpoints")
    assert last == 24 and listed(killed / "checkpoints")[1] == 24
    expected, got = (
        host_state(straight / "checkpoints", 24),
        host_state(killed / "checkpoints", 24),
    )
    assert got["history"] == expected["history"]
    assert got["data"] == expected["data"]
    assert got["data"] == {"epoch": 2, "position": 0, "batch_size": 128}


def test_a_folder_without_the_splits_is_refused(tmp_path):
    line = refused(tmp_path, "train", "--dataset", f"records:{tmp_path}")
    assert line.startswith(
        f"phalanx train: error: --dataset records:{tmp_path}: split 'train'"
    )
    assert "px.data.write_records" in line


def test_a_folder_of_per_token_labels_is_refused(tmp_path):
    tokens = np.arange(24, dtype=np.int32).reshape(4, 6)
    for split in ("train", "test"):
        px.data.write_records(tmp_path, split, [(tokens[:, :-1], tokens[:, 1:])])
    line = refused(tmp_path, "train", "--dataset", f"records:{tmp_path}")
    assert line == (
        f"phalanx train: error: --dataset records:{tmp_path}: train's labels have "
        "shape [5] per example; phalanx train fits a classifier, one int label per "
        "example: train on these from Python, with px.data.GrainLoader over "
        "px.data.Records(folder, 'train').dataset()"
    )
