"""Checkpoints: exact resume (mid-epoch and at epoch ends), restore onto
another strategy and device count, atomic saves, clear errors."""

import errno
import json
import logging
import os
import pathlib
import signal
import threading

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from typing_extensions import override

import phalanx as px
from helpers import RaiseAt, StopAt, make_data, make_model, max_abs_diff
from phalanx._preemption import Preempted
from phalanx.checkpoint._errors import OrbaxErrorFilter, write_error
from phalanx.checkpoint._folder import CheckpointFolder


def run(directory, *, strategy=None, crash=None, resume=None, epochs=3, every=5):
    x, y = make_data(100, seed=3)
    loader = px.data.ArrayLoader((x, y), 16, seed=1)  # 7 steps per epoch
    callbacks: list[px.Callback] = [
        px.callbacks.Checkpoint(directory, every_n_steps=every)
    ]
    if crash is not None:
        callbacks.insert(0, RaiseAt(crash))  # a killed process: no save on the way out
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=strategy or px.PmapStrategy(8),
        callbacks=callbacks,
    )
    if crash is None:
        trainer.fit(loader, epochs=epochs, resume=resume)
    else:
        with pytest.raises(RuntimeError, match=f"boom at step {crash}"):
            trainer.fit(loader, epochs=epochs, resume=resume)
    return trainer, loader


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return run(tmp_path_factory.mktemp("straight"))


# Killed at step 6 (newest checkpoint: step 5, mid-epoch), at step 8 (step 7,
# the first epoch's end) and at step 12 (step 10, mid-epoch later on).
@pytest.mark.parametrize(("crash_at", "saved"), [(6, 5), (8, 7), (12, 10)])
def test_resume_is_exact(tmp_path, straight, crash_at, saved):
    reference, reference_loader = straight
    run(tmp_path, crash=crash_at)
    assert max(int(p) for p in os.listdir(tmp_path) if p.isdigit()) == saved
    resumed, loader = run(tmp_path, resume="latest")
    assert max_abs_diff(resumed.model, reference.model) == 0
    assert int(resumed.state.step) == int(reference.state.step) == 21
    np.testing.assert_array_equal(
        jax.random.key_data(resumed.state.key), jax.random.key_data(reference.state.key)
    )
    assert resumed.history.epochs == reference.history.epochs
    assert loader.state_dict() == reference_loader.state_dict()


def test_a_run_resumed_on_the_short_last_batch_pads_it_as_the_pass_did(tmp_path):
    # Saved at step 3 of a list of 16, 16, 16 and 4 examples: the resumed run
    # starts on the 4, which the straight run padded to the pass's 16 rows;
    # padded to 8 (the devices' multiple) they sum in another order.
    x, y = make_data(52, seed=4)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 52, 16)]

    def trainer(*callbacks):
        return px.DataParallelTrainer(
            make_model(), optax.adam(1e-2), callbacks=callbacks, progress=False
        )

    straight = trainer()
    straight.fit(batches, epochs=2)
    saving = px.callbacks.Checkpoint(tmp_path, every_n_steps=3, every_n_epochs=None)
    trainer(saving, StopAt(3)).fit(batches, epochs=2)
    resumed = trainer()
    resumed.fit(batches, epochs=2, resume=tmp_path / "3")
    assert max_abs_diff(resumed.model, straight.model) == 0
    assert resumed.history.epochs == straight.history.epochs


def test_restore_onto_other_strategies(tmp_path):
    # Saved from 8 devices under ShardingStrategy; restored onto 2 devices under
    # PmapStrategy and onto 8 under AccumulatingStrategy: the same values.
    trained, _ = run(tmp_path, strategy=px.ShardingStrategy(8), epochs=1, every=7)
    for strategy, devices in (
        (px.PmapStrategy(2), 2),
        (px.AccumulatingStrategy(px.ShardingStrategy(8), 2), 8),
    ):
        other = px.DataParallelTrainer(
            make_model(seed=9), optax.adam(1e-2), strategy=strategy
        )
        other.fit([make_data(16)], steps=7, resume=tmp_path / "7")  # nothing left
        assert max_abs_diff(other.model, trained.model) == 0
        weight = other.state.model.layers[0].weight
        assert len(weight.sharding.device_set) == devices
        other.fit([make_data(16)], steps=1)  # and it trains on from there
        assert int(other.state.step) == 8


def test_keep_newest(tmp_path):
    run(tmp_path, epochs=2, every=2)
    assert sorted(os.listdir(tmp_path)) == ["10", "12", "14"]  # keep=3 of 2, ..., 14


def test_old_steps_leave_by_rename(tmp_path, monkeypatch):
    # A kill while an old step is deleted must not leave a half-deleted folder
    # that still lists as a checkpoint: the step is renamed out of the listing
    # (atomic) first. Here the renamed folders are not emptied, as if the
    # process died right after each rename: each is whole, none is listed.
    with monkeypatch.context() as patch:
        patch.setattr(CheckpointFolder, "_empty_trash", lambda self: None)
        run(tmp_path, epochs=2, every=2)
    assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["10", "12", "14"]
    retired = tmp_path / "retired"
    assert sorted(os.listdir(retired), key=int) == ["2", "4", "6", "7", "8"]
    for step in os.listdir(retired):
        assert (retired / step / "_CHECKPOINT_METADATA").is_file()
    # The next run on the folder empties them.
    run(tmp_path, epochs=2, every=2, resume="latest")
    assert sorted(os.listdir(tmp_path)) == ["10", "12", "14"]


@pytest.mark.parametrize("every", [3, 7])  # 7: step saves fall on epoch ends
@pytest.mark.parametrize("mode", ["min", "max"])
def test_keep_best_by_monitor(tmp_path, every, mode):
    # keep=2 epoch ends by eval_loss, and the newest checkpoint of any kind;
    # mid-epoch snapshots are dropped once a newer one exists.
    x, y = make_data(100, seed=3)
    checkpoint = px.callbacks.Checkpoint(
        tmp_path, every_n_steps=every, keep=2, monitor="eval_loss", mode=mode
    )
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[checkpoint]
    )
    loader = px.data.ArrayLoader((x, y), 16, seed=1)  # 7 steps per epoch
    trainer.fit(loader, epochs=5, eval_data=[make_data(32, seed=4)])
    losses = [epoch["eval_loss"] for epoch in trainer.history.epochs]
    ranked = sorted(range(5), key=losses.__getitem__, reverse=mode == "max")
    best = {7 * (e + 1) for e in ranked[:2]}
    kept = sorted(int(p) for p in os.listdir(tmp_path) if p.isdigit())
    assert kept == sorted(best | {35})
    with ocp.CheckpointManager(tmp_path) as manager:
        for step in kept:  # every epoch end keeps its metrics
            assert manager.metrics(step)["eval_loss"] == losses[step // 7 - 1]


def test_bad_resume_inputs(tmp_path):
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    data = [make_data(16)]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trainer.fit(data, resume=tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        trainer.fit(data, resume=tmp_path)
    with pytest.raises(ValueError, match="needs a px.callbacks.Checkpoint"):
        trainer.fit(data, resume="latest")
    assert int(trainer.state.step) == 0
    run(tmp_path / "ckpt", epochs=1, every=7)
    other = px.DataParallelTrainer(
        px.models.MLP(5, 3, hidden=(16,), key=jax.random.key(0)), optax.adam(1e-2)
    )
    with pytest.raises(ValueError, match=r"another model.*\[16, 5\]"):
        other.fit(data, resume=tmp_path / "ckpt")
    with pytest.raises(PermissionError, match="not writable"):
        (tmp_path / "file").write_text("x")
        px.DataParallelTrainer(
            make_model(),
            optax.adam(1e-2),
            callbacks=[px.callbacks.Checkpoint(tmp_path / "file" / "sub")],
        ).fit(data)


def test_a_store_is_declared_by_its_base_class(tmp_path):
    # A callback subclassing SnapshotStore is one: it runs after the others
    # and fit(resume=) asks it; the same methods without the base class make
    # an ordinary callback.
    asked = []

    class Store(px.Callback, px.checkpoint.SnapshotStore):
        @override
        def save_snapshot(self, snapshot, *, wait=False):
            return tmp_path

        @override
        def load_snapshot(self, resume, like):
            asked.append(resume)

    class LookAlike(px.Callback):
        def save_snapshot(self, snapshot, *, wait=False):
            raise AssertionError("not a store")

        def load_snapshot(self, resume, like):
            raise AssertionError("not a store")

    store, plain = Store(), LookAlike()
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[store, plain]
    )
    assert trainer.callbacks == (plain, store)
    trainer.fit([make_data(16)], steps=1, resume="latest")
    assert asked == ["latest"] and int(trainer.state.step) == 1


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_resume_latest_on_a_first_run_starts_fresh(tmp_path, capsys, folder):
    # One script for a fresh and a preempted run: nothing to resume yet.
    directory = tmp_path / "ckpt"
    if folder == "empty":
        directory.mkdir()
    trainer, _ = run(directory, resume="latest", epochs=1, every=7)
    assert int(trainer.state.step) == 7
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"phalanx: resume='latest': no checkpoint in {directory} yet; starting fresh"
    ]
    assert (directory / "7").is_dir()


def test_resume_latest_skips_an_unreadable_newest_checkpoint(
    tmp_path, capsys, straight
):
    run(tmp_path, epochs=2)  # steps 5, 7, 10, 14 (keep 3: 7, 10, 14)
    (tmp_path / "14" / "host" / "metadata").write_text("{")
    capsys.readouterr()
    run(tmp_path, resume="latest", epochs=2)  # from 10, to 14 again
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith(
        f"phalanx: resume='latest': skipped checkpoint {tmp_path}/14, which "
        "cannot be read (JSONDecodeError: "
    ), err
    assert err[0].endswith(f"resuming from {tmp_path}/10")
    # 7 steps an epoch: step 10 is in the second.
    assert err[1] == f"phalanx: resumed from step 10 (epoch 2) of {tmp_path}/10"
    # Step 14 was saved anew: the rest of the run resumes from it, exactly.
    resumed, _ = run(tmp_path, resume="latest")
    assert capsys.readouterr().err.splitlines() == [
        f"phalanx: resumed from step 14 (epoch 3) of {tmp_path}/14"
    ]
    assert max_abs_diff(resumed.model, straight[0].model) == 0


def test_sigterm_saves_at_the_step_boundary(tmp_path, straight):
    class Term(px.Callback):
        @override
        def on_step_end(self, info):
            if info.step == 9:
                os.kill(os.getpid(), signal.SIGTERM)

    x, y = make_data(100, seed=3)
    loader = px.data.ArrayLoader((x, y), 16, seed=1)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=px.PmapStrategy(8),
        callbacks=[Term(), px.callbacks.Checkpoint(tmp_path, every_n_steps=5)],
    )
    with pytest.raises(KeyboardInterrupt, match="SIGTERM") as info:
        trainer.fit(loader, epochs=3)
    assert isinstance(info.value, Preempted)
    assert info.value.exit_code == 143
    assert "9" in os.listdir(tmp_path)
    resumed, _ = run(tmp_path, resume="latest")
    assert max_abs_diff(resumed.model, straight[0].model) == 0


def test_corrupt_checkpoint_is_refused(tmp_path):
    run(tmp_path, epochs=1, every=7)
    for path in (tmp_path / "7" / "arrays").rglob("*"):
        if path.is_file() and path.stat().st_size > 64:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    with pytest.raises(ValueError, match="cannot be read.*corrupt"):
        trainer.fit([make_data(16)], resume=tmp_path / "7")
    assert int(trainer.state.step) == 0


@pytest.mark.parametrize("older", [1, 2, 3])
def test_older_checkpoint_format_is_refused(tmp_path, older):
    run(tmp_path, epochs=1, every=7)
    # Format 1 (phalanx 0.1.0) had no "format" entry; 2 kept the sums apart;
    # 3 had no rate multiplier in the state.
    host = tmp_path / "7" / "host" / "metadata"
    content = json.loads(host.read_text())
    if older == 1:
        del content["format"]
    else:
        content["format"] = older
    host.write_text(json.dumps(content))
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    with pytest.raises(
        ValueError, match=rf"checkpoint format {older}; .* formats 4 to 6"
    ):
        trainer.fit([make_data(16)], resume=tmp_path / "7")
    assert int(trainer.state.step) == 0


def test_training_goes_on_while_a_save_is_written(tmp_path, monkeypatch):
    """A save queues copies of the arrays and returns; the writer thread
    waits for the devices and hands them to orbax while steps go on."""
    written = threading.Event()
    write = CheckpointFolder._write

    def held(self, step, *args, **kwargs):
        if step == 5:  # hold the first save until training is 4 steps further
            assert written.wait(timeout=30), "training waited for the writer"
        write(self, step, *args, **kwargs)

    class Release(px.Callback):
        @override
        def on_step_end(self, info):
            if info.step == 9:
                written.set()

    monkeypatch.setattr(CheckpointFolder, "_write", held)
    x, y = make_data(100, seed=3)

    def trained(steps, callbacks=()):
        trainer = px.DataParallelTrainer(
            make_model(),
            optax.adam(1e-2),
            strategy=px.ShardingStrategy(8),
            callbacks=callbacks,
        )
        if steps:
            trainer.fit(px.data.ArrayLoader((x, y), 16, seed=1), steps=steps)
        return trainer

    # (no epoch-end save: a save waits for the one before it to be handed over)
    checkpoint = px.callbacks.Checkpoint(tmp_path, every_n_steps=5, every_n_epochs=None)
    trained(10, [Release(), checkpoint])
    with ocp.CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [5, 10]
    # The held save holds step 5's state, not a later one.
    restored = trained(0)
    checkpoint.restore(restored, tmp_path / "5", None)
    assert max_abs_diff(restored.model, trained(5).model) == 0


def _tensorstore_error(code: int) -> Exception:
    """An error as orbax raises one from TensorStore: the OS error's code in
    the text, a spec dump, a chain of wrappers."""
    inner = ValueError(
        'OUT_OF_RANGE: Error writing "float32/0" in OCDBT database at local file '
        f'"/x/ckpt/10.orbax-checkpoint-tmp/": Failed to write 6207 bytes to file '
        f"4: {os.strerror(code)} [os_error_code='{code}']"
    )
    try:
        try:
            raise inner
        except ValueError as error:
            raise Exception(
                "See full TensorStore details: <spec of TensorStore({\n 'a': 1\n})>"
            ) from error
    except Exception as outer:
        return outer


@pytest.mark.parametrize(
    ("code", "what", "fix"),
    [
        (errno.ENOSPC, "no space left on the device", "free space on that disk"),
        (errno.EFBIG, "file size limit (ulimit -f)", "ulimit -f unlimited"),
        (errno.EACCES, "not writable (permission denied)", "chmod u+w"),
        (errno.EROFS, "read-only", "remount it read-write"),
    ],
)
@pytest.mark.parametrize("how", ["os", "tensorstore"])
def test_write_errors_say_what_failed_where_and_what_to_do(code, what, fix, how):
    error = (
        OSError(code, os.strerror(code), "/x/ckpt/10")
        if how == "os"
        else _tensorstore_error(code)
    )
    failure = write_error(error, pathlib.Path("/x/ckpt"), 10, [5])
    message = str(failure)
    assert isinstance(failure, OSError) and failure.errno == code
    assert message.startswith("Checkpoint: saving step 10 into /x/ckpt failed: ")
    for phrase in (what, fix, "newest: step 5", "resume='latest'"):
        assert phrase in message, message
    assert "TensorStore" not in message and "\n" not in message


def test_orbax_error_logs_are_filtered_and_nothing_else():
    def raised_in(filename: str) -> BaseException:
        try:
            exec(compile("raise ValueError('write failed')", filename, "exec"))
        except ValueError as error:
            return error
        raise AssertionError("not raised")

    def record(name: str, level: int, error: BaseException | None, path="x.py"):
        exc_info = None if error is None else (type(error), error, error.__traceback__)
        return logging.LogRecord(name, level, path, 1, "msg", None, exc_info)

    orbax = raised_in("/site-packages/orbax/checkpoint/_src/serialization.py")
    mine = raised_in("/home/me/train.py")
    keep = OrbaxErrorFilter().filter
    assert not keep(record("asyncio", logging.ERROR, orbax))  # never retrieved
    assert not keep(record("absl", logging.ERROR, None, "/s/orbax/checkpoint/a.py"))
    assert keep(record("asyncio", logging.ERROR, mine))
    assert keep(record("absl", logging.WARNING, None, "/s/orbax/checkpoint/a.py"))
    assert keep(record("asyncio", logging.WARNING, orbax))
