"""Linear regression on eight devices: recover known weights from noisy data.

Shows the smallest complete phalanx run: a `px.models.Linear` model, the
built-in ``loss="mse"`` and `px.PmapStrategy` over every local device (eight
fake CPU devices here). Each step splits the batch across the devices, each
device takes the gradient of its slice, and one all-reduce adds them up, so
the update is the one a single device would make on the whole batch.

Run: ``python examples/linear_regression.py [--epochs N] [--steps N]``
"""

import argparse

import jax
import numpy as np
import optax

import phalanx as px


# Before JAX creates any array: eight CPU devices on a CPU-only host.
px.fake_cpu_devices(8)


def make_data(
    rng: np.random.Generator, n: int, w: np.ndarray, b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """n examples of ``y = w x + b + noise``."""
    x = rng.normal(size=(n, w.shape[1])).astype(np.float32)
    noise = 0.01 * rng.normal(size=(n, w.shape[0]))
    return x, (x @ w.T + b + noise).astype(np.float32)


def fmt(values: np.ndarray) -> str:
    return "[" + ", ".join(f"{v:+.3f}" for v in values.ravel()) + "]"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the data")
    parser.add_argument("--steps", type=int, help="stop after this many updates")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    true_w = np.array([[2.0, -3.0, 0.5, 1.0]], np.float32)
    true_b = np.array([0.7], np.float32)
    x, y = make_data(rng, 2048, true_w, true_b)
    batches = px.data.ArrayLoader((x, y), batch_size=256, seed=0)

    strategy = px.PmapStrategy()
    print(f"linear regression on {strategy.num_devices} devices (PmapStrategy)")
    model = px.models.Linear(4, 1, key=jax.random.key(0))
    trainer = px.DataParallelTrainer(
        model, optax.sgd(0.1), strategy=strategy, loss="mse"
    )
    trainer.fit(batches, epochs=None if args.steps else args.epochs, steps=args.steps)

    w = np.asarray(trainer.model.layer.weight)
    b = np.asarray(trainer.model.layer.bias)
    epochs, mse = len(trainer.history), trainer.history[-1]["loss"]
    print(f"mse after {epochs} epoch(s): {mse:.6f}")
    print(f"true    w = {fmt(true_w)}  b = {fmt(true_b)}")
    print(f"learned w = {fmt(w)}  b = {fmt(b)}")
    error = max(np.abs(w - true_w).max(), np.abs(b - true_b).max())
    print(f"max |learned - true| = {error:.4f}")


if __name__ == "__main__":
    main()
