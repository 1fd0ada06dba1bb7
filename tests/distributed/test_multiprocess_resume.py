"""``fit(resume="latest")`` across processes (issue 45, acceptance 6): on 2
processes × 4 fake CPU devices, with no checkpoint yet it starts fresh, and
with checkpoints it resumes, ending where 1 process × 8 devices ends.

It used to abort every time on a folder not made yet: process 0 found no
folder and went on to train (its `Checkpoint` making the folder), process 1
then found the folder and opened an orbax manager on it, whose collectives
met process 0's first batch check (garbage bytes, then gloo aborted). Now
process 0's view decides on every process."""

import pathlib

import pytest

import phalanx as px
from multiprocess_run import STRATEGIES, parameters, train
from test_multiprocess import assert_ranks_hold, launch


# Each strategy's tolerance against one process: with the deterministic
# reduction 2 processes end bitwise where 1 ends; the default strategy's
# all-reduce sums in another order.
TOLERANCE = {"sharding-deterministic": 0, "sharding": 1e-6}
# Where the checkpoint folder exists, empty, before the first fit (for the
# others the first fit's Checkpoint makes it).
MADE = {"sharding"}
# The strategy of the run resumed past a damaged checkpoint.
DAMAGED = "sharding-deterministic"


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[pathlib.Path, str]:
    """One launch of 2 processes × 4 devices: for each strategy, a fit to
    step 13 with ``resume="latest"`` saving every 5 steps in
    OUT/checkpoints-NAME (nothing there yet: it starts fresh), in
    OUT/fresh-NAME, then one to step 20 resuming from it, in
    OUT/resumed-NAME. The folder and the launch's output."""
    out = tmp_path_factory.mktemp("resumed")
    jobs = []
    for name in TOLERANCE:
        checkpoints = out / f"checkpoints-{name}"
        if name in MADE:
            checkpoints.mkdir()
        # Process 1 looks for checkpoints after process 0 has gone on.
        jobs.append(f"fresh-{name}={name}:13:{checkpoints}:late")
        jobs.append(f"resumed-{name}={name}:20:{checkpoints}:resume")
    # 1 process saved (steps 5, 10, 13), step 13 damaged: 2 resume from 10.
    damaged = out / "checkpoints-damaged"
    one = px.callbacks.Checkpoint(damaged, every_n_steps=5)
    train(STRATEGIES[DAMAGED](8), [one], steps=13)
    (damaged / "13" / "host" / "metadata").write_text("{")
    jobs.append(f"damaged={DAMAGED}:20:{damaged}:resume")
    done = launch(str(out), *jobs, devices=4)
    return out, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TOLERANCE))
def test_resume_latest_across_processes(launched, name):
    out, output = launched
    atol = TOLERANCE[name]
    checkpoints = out / f"checkpoints-{name}"
    # Nothing to resume from: started fresh, said once (by process 0).
    fresh = f"no checkpoint in {checkpoints} yet; starting fresh"
    assert [line[:4] for line in output.splitlines() if fresh in line] == ["[0] "]
    assert_ranks_hold(
        out / f"fresh-{name}",
        parameters(train(STRATEGIES[name](8), steps=13)),
        atol=atol,
    )
    # Checkpoints at 5, 10 and 13: resumed from 13.
    resumed = f"resumed from step 13 (epoch 3) of {checkpoints}/13"
    assert [line[:4] for line in output.splitlines() if resumed in line] == ["[0] "]
    assert_ranks_hold(
        out / f"resumed-{name}", parameters(train(STRATEGIES[name](8))), atol=atol
    )


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_skipped_on_every_process(launched):
    out, output = launched
    damaged = out / "checkpoints-damaged"
    lines = output.splitlines()
    skipped = f"resume='latest': skipped checkpoint {damaged}/13, which cannot be read"
    assert [line[:4] for line in lines if skipped in line] == ["[0] "]
    resumed = f"resumed from step 10 (epoch 1) of {damaged}/10"
    assert [line[:4] for line in lines if resumed in line] == ["[0] "]
    straight = parameters(train(STRATEGIES[DAMAGED](8)))
    assert_ranks_hold(out / "damaged", straight, atol=0)


@pytest.mark.slow
def test_processes_agree_on_what_they_read():
    # Process 0's view decides; a read that fails on one process fails on all,
    # for the reason (and naming the process) where it failed.
    script = """
import jax
import phalanx as px
from phalanx.checkpoint._agreement import failed_on, from_process_zero
px.distributed.initialize()
rank = jax.process_index()
print("seen", from_process_zero([rank, "steps", None]), from_process_zero(rank == 1))
print("read", failed_on(None), failed_on("truncated" if rank == 1 else None))
"""
    output = launch("-c", script, devices=1).stdout.splitlines()
    for rank in (0, 1):
        assert f"[{rank}] seen [0, 'steps', None] False" in output
    for rank in (0, 1):
        assert f"[{rank}] read None on process 1: truncated" in output
