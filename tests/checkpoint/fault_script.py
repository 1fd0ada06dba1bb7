"""A user's own training script, for the fault suite (test_faults.py): a
small MLP on 2 fake CPU devices with a Checkpoint every 5 steps, resuming
whenever it can. Usage: ``python fault_script.py CHECKPOINT_FOLDER``.

Each step also sleeps a little, as a real model's step takes a while, so
that a fault can be made to land between two saves."""

import os
import sys
import time


# Two fake devices: XLA:CPU's all-reduce needs 2 pool threads per device.
os.environ.setdefault("NPROC", "4")

import jax  # noqa: E402


jax.config.update("jax_num_cpu_devices", 2)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from typing_extensions import override  # noqa: E402

import phalanx as px  # noqa: E402


STEPS = 120


class Slow(px.Callback):
    @override
    def on_step_end(self, info: px.StepInfo) -> None:
        time.sleep(0.05)


def main(folder: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 5)).astype(np.float32)
    y = rng.integers(0, 3, size=256).astype(np.int32)
    model = px.models.MLP(5, 3, hidden=(64,), key=jax.random.key(0))
    checkpoint = px.callbacks.Checkpoint(folder, every_n_steps=5)
    trainer = px.DataParallelTrainer(
        model, optax.adam(1e-3), callbacks=[Slow(), checkpoint]
    )
    loader = px.data.ArrayLoader((x, y), 32)
    trainer.fit(loader, steps=STEPS, resume="latest")
    print(f"done at step {int(trainer.state.step)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
