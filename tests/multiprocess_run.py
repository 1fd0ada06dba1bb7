"""One small training run, the same in one process and in several (imported
by test_multiprocess.py and by the processes it launches)."""

import equinox as eqx
import jax
import numpy as np
import optax

import phalanx as px


STRATEGIES = {
    "sharding": lambda n: px.ShardingStrategy(n),
    "pmap": lambda n: px.PmapStrategy(n),
    "accumulating": lambda n: px.AccumulatingStrategy(px.ShardingStrategy(n), 2),
}


def train(strategy: px.Strategy, callbacks=()) -> px.DataParallelTrainer:
    """An MLP, adam, 20 steps over an ArrayLoader, which hands each process
    its slice of every global batch of 64."""
    x = np.random.default_rng(0).standard_normal((640, 20)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 3, 640).astype(np.int32)
    model = px.models.MLP(20, 3, hidden=(16,), key=jax.random.key(0))
    trainer = px.DataParallelTrainer(
        model, optax.adam(1e-2), strategy=strategy, callbacks=callbacks
    )
    trainer.fit(px.data.ArrayLoader((x, y), 64, seed=1), steps=20)
    return trainer


def parameters(trainer: px.DataParallelTrainer) -> list[np.ndarray]:
    """The model's arrays as this process holds them (replicated)."""
    return [
        np.asarray(leaf.addressable_shards[0].data)
        for leaf in jax.tree.leaves(eqx.filter(trainer.model, eqx.is_array))
    ]


if __name__ == "__main__":  # under phalanx launch: argv = strategy, out folder
    import sys

    px.distributed.initialize()
    name, out = sys.argv[1:]
    logs = [
        px.callbacks.CSVLogger(f"{out}/metrics.csv", log_every=5),
        px.callbacks.ProgressBar(log_every=5),
    ]
    trainer = train(STRATEGIES[name](None), logs)
    np.savez(f"{out}/rank{jax.process_index()}.npz", *parameters(trainer))
    print("history", trainer.history[-1])
