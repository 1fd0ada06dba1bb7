"""A small 2-process run that goes wrong on purpose (run by
test_recover.py under ``phalanx launch``): ``recover_run.py OUT MODE``.

MODE ``callback``: rank 1 sleeps for ever in a callback at step 3 (no
Checkpoint: the hang dumps go to ./phalanx-hang). ``restart``: 20 steps with
a checkpoint every 2 and ``resume="latest"``; in the launch's first start
rank 1 kills itself with SIGKILL at step 7, in the second rank 0's
checkpoint write of step 14 never returns, the third finishes; each rank
saves its parameters in OUT/rank{r}.npz. Every line that times the run says
``at <time.time()>``.
"""

import os
import signal
import sys
import time

import jax
import numpy as np

import phalanx as px
from multiprocess_run import STRATEGIES, parameters, train
from phalanx.checkpoint._folder import CheckpointFolder


HANG_TIMEOUT = 8.0
RESTART = int(os.environ.get("PHALANX_RESTART_COUNT", "0"))


class Trouble(px.Callback):
    """Says each step's end; hangs or dies at `(restart, rank, step, how)`."""

    def __init__(self, *faults: tuple[int, int, int, str]):
        self.faults = faults

    def on_step_end(self, info: px.StepInfo) -> None:
        rank = jax.process_index()
        print(f"step {info.step} of restart {RESTART} at {time.time():.3f}")
        for restart, at_rank, step, how in self.faults:
            if (restart, at_rank, step) == (RESTART, rank, info.step):
                print(f"{how} at {time.time():.3f}", flush=True)
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)


def hang_in_checkpoint_write(restart: int, rank: int, step: int) -> None:
    """In start `restart`, rank `rank`'s write of `step`'s checkpoint never
    returns."""
    save = CheckpointFolder.save

    def stuck(self, snapshot, metrics, *, wait):
        here = (RESTART, jax.process_index(), snapshot.progress.step)
        if here == (restart, rank, step):
            print(f"hang at {time.time():.3f}", flush=True)
            time.sleep(3600)
        return save(self, snapshot, metrics, wait=wait)

    CheckpointFolder.save = stuck


def main(out: str, mode: str) -> None:
    px.distributed.initialize()
    print(f"pid {os.getpid()}")
    strategy = STRATEGIES["sharding-deterministic"](None)
    if mode == "callback":
        train(strategy, [Trouble((0, 1, 3, "hang"))], hang_timeout=HANG_TIMEOUT)
        return
    checkpoint = px.callbacks.Checkpoint(f"{out}/checkpoints", every_n_steps=2)
    hang_in_checkpoint_write(1, 0, 14)
    faults = Trouble((0, 1, 7, "kill"))
    trainer = train(
        strategy, [faults, checkpoint], resume="latest", hang_timeout=HANG_TIMEOUT
    )
    np.savez(f"{out}/rank{jax.process_index()}.npz", *parameters(trainer))


if __name__ == "__main__":
    main(*sys.argv[1:])
