"""One run of a tiny MLP on a `px.data.GrainLoader`, as a process of its own
(run by test_grain_resume.py, alone or under ``phalanx launch``):

    python grain_run.py OUT STEPS [--workers N] [--checkpoints DIR]
        [--resume] [--kill-at STEP] [--direct]

Example ``i``'s features start with ``i``, and every example the source
reads is logged, by whichever process or grain worker reads it, as a line
``i`` in OUT/reads-PID.txt. The run's parameters go to OUT/rankR.npz.
"""

import argparse
import os
import signal
import sys

import equinox as eqx
import jax
import numpy as np
import optax

import phalanx as px


EXAMPLES = 1600  # 100 global batches of 16: an epoch the tests never finish
BATCH = 16  # 2 per device on 8: no padding, on 1 process or 2


class Source:
    """Random access to `EXAMPLES` examples, logging each read."""

    def __init__(self, log: str | None):
        self.log = log

    def __len__(self) -> int:
        return EXAMPLES

    def __repr__(self) -> str:  # grain's DataLoader checks it on restore
        return "Source()"

    def __getitem__(self, index: int):
        if self.log is not None:
            with open(f"{self.log}/reads-{os.getpid()}.txt", "a") as file:
                file.write(f"{index}\n")
        features = np.random.default_rng(index).standard_normal(6).astype(np.float32)
        features[0] = index
        return features, np.int32(index % 3)


def loader(
    log: str | None = None, workers: int = 0, **processes
) -> px.data.GrainLoader:
    return px.data.GrainLoader(
        Source(log), BATCH, seed=3, worker_count=workers, **processes
    )


def direct(log: str | None, workers: int = 0):
    """grain's own DataLoader, each process reading its own shard
    (``ShardByJaxProcess``) in batches of its slice of `BATCH`, shuffled
    once: given to fit as it is."""
    import grain

    sampler = grain.samplers.IndexSampler(
        EXAMPLES,
        shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
        shuffle=True,
        num_epochs=1,
        seed=3,
    )
    return grain.DataLoader(
        data_source=Source(log),
        sampler=sampler,
        operations=[grain.transforms.Batch(BATCH // jax.process_count())],
        worker_count=workers,
    )


def trainer(callbacks=()) -> px.DataParallelTrainer:
    model = px.models.MLP(6, 3, hidden=(8,), key=jax.random.key(0))
    return px.DataParallelTrainer(
        model,
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(deterministic=True),
        callbacks=list(callbacks),
        progress=False,
    )


def parameters(trained: px.DataParallelTrainer) -> list[np.ndarray]:
    return [
        np.asarray(leaf)
        for leaf in jax.tree.leaves(eqx.filter(trained.model, eqx.is_array))
    ]


class KillAt(px.Callback):
    """SIGKILL this process at step `step`'s end, before its checkpoint
    (checkpoints come after every other callback) and once the previous
    step's is on disk: a resume goes on from step ``step - 1``."""

    def __init__(self, step: int, checkpoint: px.callbacks.Checkpoint):
        self.step, self.checkpoint = step, checkpoint

    def on_step_end(self, info):
        if info.step == self.step:
            self.checkpoint._folder.wait()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("steps", type=int)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--checkpoints", default=None)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--direct", action="store_true", help="grain.DataLoader")
    args = parser.parse_args()
    px.distributed.initialize()  # under phalanx launch; else nothing
    callbacks: list[px.Callback] = []
    if args.checkpoints:
        checkpoint = px.callbacks.Checkpoint(args.checkpoints, every_n_steps=1)
        callbacks.append(checkpoint)
        if args.kill_at is not None:
            callbacks.append(KillAt(args.kill_at, checkpoint))
    run = trainer(callbacks)
    data = (direct if args.direct else loader)(args.out, args.workers)
    run.fit(data, steps=args.steps, resume="latest" if args.resume else None)
    if isinstance(data, px.data.GrainLoader):
        data.close()
    np.savez(f"{args.out}/rank{jax.process_index()}.npz", *parameters(run))


if __name__ == "__main__":
    sys.exit(main())
