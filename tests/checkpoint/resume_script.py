"""The runs of test_resume_process.py, built alike in the test's process and
in a process of their own.

``logged``: a fit with two shuffled evaluation sets (evaluated at each
epoch's end), EMA, F1 and AUC by name, two steps per compiled call,
`Throughput`, a JSON and a CSV logger and a checkpoint every 5 steps.
``ragged``: a list of batches of 16, 16, 16 and 4 examples, checkpointed at
step 3 (the resumed run starts on the short batch). The test trains each
straight and stopped in its own process; ``python resume_script.py
FOLDER`` then resumes each from FOLDER/<name>/checkpoints
(``FOLDER/ragged/checkpoints/3`` for ``ragged``) and writes its state
(``state.npz``) and history (``history.json``) beside them.
"""

import json
import os
import pathlib
import sys
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax

import phalanx as px


EPOCHS = 3


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    return x, rng.integers(0, 3, size=n).astype(np.int32)


def _trainer(callbacks, **options) -> px.DataParallelTrainer:
    model = px.models.MLP(5, 3, hidden=(8,), key=jax.random.key(0))
    return px.DataParallelTrainer(
        model, optax.adam(1e-2), callbacks=callbacks, progress=False, **options
    )


def logged(folder: pathlib.Path, *callbacks: px.Callback, resume=None):
    """Train the ``logged`` run, its logs and checkpoints in `folder`."""
    x, y = _data(100, seed=3)
    x_val, y_val = _data(45, seed=4)
    trainer = _trainer(
        [
            *callbacks,
            # Its FLOP/s (and the rates, measured) are logged after a resume too.
            px.callbacks.Throughput(log_every=3, quiet=True),
            px.callbacks.JSONLogger(folder / "metrics.jsonl", log_every=3),
            px.callbacks.CSVLogger(folder / "metrics.csv", log_every=3),
            px.callbacks.Checkpoint(folder / "checkpoints", every_n_steps=5),
        ],
        ema=0.9,
        metrics=("accuracy", "f1", "auc"),
        steps_per_call=2,
    )
    # Shuffled (the default), each pass in a new order: 7 steps an epoch.
    eval_data = {
        "val": px.data.ArrayLoader((x_val, y_val), 16, seed=2),
        "train": px.data.ArrayLoader((x[:40], y[:40]), 16, seed=5),
    }
    loader = px.data.ArrayLoader((x, y), 16, seed=1)
    trainer.fit(loader, epochs=EPOCHS, eval_data=eval_data, resume=resume)
    return trainer


def ragged(folder: pathlib.Path, *callbacks: px.Callback, resume=None):
    """Train the ``ragged`` run, its checkpoints (every 3 steps) in `folder`."""
    x, y = _data(52, seed=6)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 52, 16)]
    checkpoint = px.callbacks.Checkpoint(
        folder / "checkpoints", every_n_steps=3, every_n_epochs=None
    )
    trainer = _trainer([*callbacks, checkpoint])
    trainer.fit(batches, epochs=2, resume=resume)
    return trainer


def host_state(trainer: px.DataParallelTrainer) -> dict[str, np.ndarray]:
    """Every array of the trainer's state (PRNG keys as their data)."""
    leaves = jax.tree.leaves(eqx.filter(trainer.state, eqx.is_array))
    return {
        f"leaf_{i}": np.asarray(
            jax.random.key_data(leaf)
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
            else leaf
        )
        for i, leaf in enumerate(leaves)
    }


def main(root: pathlib.Path) -> None:
    for name, train, resume in (
        ("logged", logged, "latest"),
        ("ragged", ragged, root / "ragged" / "checkpoints" / "3"),
    ):
        folder = root / name
        trainer = train(folder, resume=resume)
        # Any: numpy types **kwargs as possibly its own allow_pickle=.
        state: dict[str, Any] = host_state(trainer)
        np.savez(folder / "state.npz", **state)
        (folder / "history.json").write_text(json.dumps(trainer.history.state_dict()))


if __name__ == "__main__":
    # Eight fake CPU devices, as the tests' own process has.
    os.environ.setdefault("NPROC", "16")
    jax.config.update("jax_num_cpu_devices", 8)
    main(pathlib.Path(sys.argv[1]))
