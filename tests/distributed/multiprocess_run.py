"""One small training run, the same in one process and in several (imported
by test_multiprocess.py, and run by the processes it launches)."""

import functools as ft
import os
import sys
import time
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import numpy as np
import optax

import phalanx as px
from phalanx.strategies._placement import to_host
from phalanx.strategies._registry import Options, Registered, registered


def _build(entry: Registered, options: Options, devices: int | None) -> px.Strategy:
    return entry.build(devices, options)


def strategies() -> dict[str, Callable[[int | None], px.Strategy]]:
    """Every registered strategy (min_size 1: the tiny model splits; the
    mesh hybrid, replicated over data (one position per process), split over
    fsdp within each process's two devices), two microbatches of the first,
    and each that can sum over devices in a fixed order (bitwise
    reproducible) so, alone and accumulating."""
    tiny = Options(min_size=lambda n: 1)
    made: dict[str, Callable[[int | None], px.Strategy]] = {
        entry.name: ft.partial(_build, entry, tiny) for entry in registered()
    }
    first = registered()[0]
    made["accumulating"] = lambda n: px.AccumulatingStrategy(first.build(n, tiny), 2)
    fixed = [entry for entry in registered() if "deterministic" in entry.options]
    for entry in fixed:
        made[f"{entry.name}-deterministic"] = ft.partial(
            _build, entry, Options(deterministic=True)
        )
    made["accumulating-deterministic"] = lambda n: px.AccumulatingStrategy(
        fixed[0].build(n, Options(deterministic=True)), 2
    )
    return made


STRATEGIES = strategies()


# Rows to predict: process 0 passes the first 5, process 1 the other 7.
PREDICT = np.random.default_rng(2).standard_normal((12, 20)).astype(np.float32)
SPLIT = 5


def train(
    strategy: px.Strategy,
    callbacks=(),
    *,
    steps: int = 20,
    resume=None,
    hang_timeout: float | Literal["auto"] | None = "auto",
) -> px.DataParallelTrainer:
    """An MLP, adam, `steps` steps (counted from the run's start) over an
    ArrayLoader, which hands each process its slice of every global batch of
    64 (`hang_timeout`: the trainer's)."""
    x = np.random.default_rng(0).standard_normal((640, 20)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 3, 640).astype(np.int32)
    model = px.models.MLP(20, 3, hidden=(16,), key=jax.random.key(0))
    trainer = px.DataParallelTrainer(
        model,
        optax.adam(1e-2),
        strategy=strategy,
        callbacks=callbacks,
        hang_timeout=hang_timeout,
    )
    loader = px.data.ArrayLoader((x, y), 64, seed=1)
    trainer.fit(loader, steps=steps, resume=resume)
    return trainer


def parameters(trainer: px.DataParallelTrainer) -> list[np.ndarray]:
    """The model's arrays, whole (those split over processes gathered: every
    process calls this)."""
    return [
        to_host(leaf)
        for leaf in jax.tree.leaves(eqx.filter(trainer.model, eqx.is_array))
    ]


def run_job(out: str, job: str) -> None:
    """One job of a launch: ``LABEL=STRATEGY`` trains 20 steps,
    ``LABEL=STRATEGY:STEPS:CHECKPOINTS:resume|late|fresh`` to STEPS saving
    every 5 steps in CHECKPOINTS (resuming from its latest, so with process
    1 starting its fit a second after process 0, or not); each writes its
    parameters, model, predictions, logs and a history line in OUT/LABEL."""
    label, spec = job.split("=")
    name, *rest = spec.split(":")
    folder = f"{out}/{label}"
    os.makedirs(folder, exist_ok=True)
    callbacks: list[px.Callback] = [
        px.callbacks.CSVLogger(f"{folder}/metrics.csv", log_every=5),
        px.callbacks.ProgressBar(log_every=5),
    ]
    steps, resume = 20, None
    if rest:
        steps, checkpoints, mode = int(rest[0]), rest[1], rest[2]
        callbacks.append(px.callbacks.Checkpoint(checkpoints, every_n_steps=5))
        resume = None if mode == "fresh" else "latest"
        if mode == "late" and jax.process_index() == 1:
            # Process 0 has looked for checkpoints and gone on by then.
            time.sleep(1)
    trainer = train(STRATEGIES[name](None), callbacks, steps=steps, resume=resume)
    np.savez(f"{folder}/rank{jax.process_index()}.npz", *parameters(trainer))
    px.save_model(f"{folder}/model.npz", trainer.model)
    mine = PREDICT[:SPLIT] if jax.process_index() == 0 else PREDICT[SPLIT:]
    np.savez(
        f"{folder}/predict{jax.process_index()}.npz",
        whole=trainer.predict(mine),
        chunked=trainer.predict(mine, batch_size=3),
    )
    print("history", label, trainer.history[-1])


if __name__ == "__main__":
    # Under phalanx launch: OUT JOB... (see run_job), one after another: a
    # launch's processes start, import and connect once for all of them.
    px.distributed.initialize()
    print(
        f"process {jax.process_index()} of {jax.process_count()}, "
        f"{jax.local_device_count()} of {jax.device_count()} devices"
    )
    for job in sys.argv[2:]:
        run_job(sys.argv[1], job)
