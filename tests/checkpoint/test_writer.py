"""The writer thread: writes run in order, a save of a small state does not
wait for a write still running (one may wait beside it), a larger one does,
and a failed write is raised once, at the next save or step."""

import dataclasses
import threading
import time

import optax
import pytest

import phalanx as px
from helpers import make_data, make_model
from phalanx.checkpoint import _packing
from phalanx.checkpoint._errors import CheckpointWriteError
from phalanx.checkpoint._folder import CheckpointFolder
from phalanx.checkpoint._writer import WriterThread


def test_writes_run_in_order_and_wait_leaves_the_newest_pending():
    writer = WriterThread("test-writer")
    gates = [threading.Event() for _ in range(3)]
    done: list[int] = []

    def write(i: int) -> None:
        assert gates[i].wait(timeout=30)
        done.append(i)
        if i == 1:
            raise OSError("disk full")

    for i in range(3):
        writer.submit(lambda i=i: write(i))
    assert writer.failed() is None  # none has ended: nothing is waited for
    for gate in gates[:2]:
        gate.set()
    error = writer.wait(1)  # the first two, not the third
    assert done == [0, 1] and isinstance(error, OSError)
    gates[2].set()
    assert writer.wait() is None and done == [0, 1, 2]
    writer.shutdown()


def trainer_and_snapshot():
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=px.ShardingStrategy(8)
    )
    trainer.fit([make_data(16)], epochs=1)
    return trainer.snapshot()


@pytest.mark.parametrize(("small", "free"), [(True, 2), (False, 1)])
def test_saves_wait_for_the_writer_only_when_it_is_behind(
    tmp_path, monkeypatch, small, free
):
    # The writer is held: a small state's saves return until two are
    # pending (one written, one waiting); a larger state's, until one is.
    if not small:
        monkeypatch.setattr(_packing, "HOST_COPY_BYTES", 16)
    release = threading.Event()
    write = CheckpointFolder._write

    def held(self, step, *args, **kwargs):
        assert release.wait(timeout=30)
        write(self, step, *args, **kwargs)

    monkeypatch.setattr(CheckpointFolder, "_write", held)
    snapshot = trainer_and_snapshot()
    folder = CheckpointFolder(tmp_path, keep=5, monitor=None, mode="min")
    folder.start()
    returned: list[int] = []

    def save(step: int) -> None:
        progress = dataclasses.replace(snapshot.progress, step=step)
        folder.save(dataclasses.replace(snapshot, progress=progress), None, wait=False)
        returned.append(step)

    saving = threading.Thread(target=lambda: [save(s) for s in (1, 2, 3)])
    saving.start()
    deadline = time.monotonic() + 30
    while len(returned) < free and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # time enough for a save that does not wait
    assert returned == [1, 2, 3][:free]  # the next one waits
    release.set()
    saving.join(timeout=30)
    assert returned == [1, 2, 3]
    folder.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == [
        "1",
        "2",
        "3",
    ]


def test_a_failed_write_is_raised_once_at_the_next_step(tmp_path, monkeypatch):
    def failing(self, step, *args, **kwargs):
        raise CheckpointWriteError(28, f"saving step {step} failed")

    monkeypatch.setattr(CheckpointFolder, "_write", failing)
    checkpoint = px.callbacks.Checkpoint(tmp_path, every_n_steps=2, every_n_epochs=None)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[checkpoint]
    )
    x, y = make_data(64)
    with pytest.raises(CheckpointWriteError, match="saving step 2 failed"):
        trainer.fit(px.data.ArrayLoader((x, y), 8), steps=8)
    assert int(trainer.state.step) < 8
