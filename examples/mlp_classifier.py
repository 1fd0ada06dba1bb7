"""Train an MLP classifier on eight devices, printing progress every epoch.

The main example: a 784-256-128-10 `px.models.MLP` trained with cross-entropy
on synthetic "MNIST-shaped" data (ten class prototypes in 784 dimensions,
blurred by noise) under `px.PmapStrategy`, or `px.ShardingStrategy` with
``--strategy sharding``. A small `px.Callback` prints the training and
held-out loss and accuracy after each epoch; `trainer.evaluate` and
`trainer.predict` finish on the test split.

Run: ``python examples/mlp_classifier.py [--epochs N] [--steps N]
[--strategy pmap|sharding]``
"""

import argparse
import time

import jax
import numpy as np
import optax
from typing_extensions import override

import phalanx as px


# Before JAX creates any array: eight CPU devices on a CPU-only host.
px.fake_cpu_devices(8)

STRATEGIES = {"pmap": px.PmapStrategy, "sharding": px.ShardingStrategy}


class PrintProgress(px.Callback):
    """Prints one line per epoch: its metrics and how long it took."""

    def __init__(self, epochs: int | None):
        self.epochs = epochs
        self.start = 0.0

    @override
    def on_epoch_start(self, info: px.StepInfo) -> None:
        self.start = time.perf_counter()

    @override
    def on_epoch_end(self, info: px.StepInfo) -> None:
        m = info.metrics
        of = f"/{self.epochs}" if self.epochs else ""
        print(
            f"epoch {info.epoch + 1:>2}{of}  step {info.step:>4}  "
            f"loss {m['loss']:.4f}  accuracy {m['accuracy']:.3f}  "
            f"test loss {m['eval_loss']:.4f}  test accuracy {m['eval_accuracy']:.3f}  "
            f"({time.perf_counter() - self.start:.2f} s)"
        )


def make_data(
    rng: np.random.Generator, n: int, prototypes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """n noisy copies of random class prototypes, with their integer labels."""
    labels = rng.integers(0, len(prototypes), size=n)
    noise = rng.normal(size=(n, prototypes.shape[1]))
    images = prototypes[labels] + SIGMA * noise
    return images.astype(np.float32), labels.astype(np.int32)


SIGMA = 1.0


def batches_of(x: np.ndarray, y: np.ndarray, size: int) -> list:
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def main(default_strategy: str = "pmap") -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5, help="passes over the data")
    parser.add_argument("--steps", type=int, help="stop after this many updates")
    parser.add_argument(
        "--strategy", choices=sorted(STRATEGIES), default=default_strategy
    )
    args = parser.parse_args()
    epochs = None if args.steps else args.epochs

    rng = np.random.default_rng(0)
    prototypes = rng.uniform(0, 1, size=(10, 784)) * 0.2
    x_train, y_train = make_data(rng, 4096, prototypes)
    x_test, y_test = make_data(rng, 1024, prototypes)
    train, test = batches_of(x_train, y_train, 256), batches_of(x_test, y_test, 256)

    strategy = STRATEGIES[args.strategy]()
    device = jax.devices()[0]
    print(
        f"{type(strategy).__name__} on {strategy.num_devices} {device.platform} "
        f"devices | MLP 784-256-128-10 | {len(x_train)} train / {len(x_test)} test "
        f"examples, batch 256 ({256 // strategy.num_devices} per device)"
    )
    model = px.models.MLP(784, 10, hidden=(256, 128), key=jax.random.key(0))
    trainer = px.DataParallelTrainer(
        model,
        optax.adam(1e-3),
        strategy=strategy,
        loss="cross_entropy",
        callbacks=[PrintProgress(epochs)],
    )
    trainer.fit(train, epochs=epochs, steps=args.steps, eval_data=test)

    results = trainer.evaluate(test)
    print(f"test loss {results['loss']:.4f}  test accuracy {results['accuracy']:.3f}")
    predicted = np.asarray(jax.numpy.argmax(trainer.predict(x_test[:12]), axis=-1))
    print(f"predicted {predicted.tolist()}\ntrue      {y_test[:12].tolist()}")


if __name__ == "__main__":
    main()
