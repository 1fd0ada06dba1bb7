"""Train an MLP classifier on eight devices, printing progress every epoch.

The main example: a 784-256-128-10 `px.models.MLP` trained with cross-entropy
on synthetic "MNIST-shaped" data (ten class prototypes in 784 dimensions,
buried in noise) under `px.PmapStrategy`, or `px.ShardingStrategy` with
``--strategy sharding``. A small `px.Callback` prints the training and test
loss and accuracy after each epoch; `trainer.evaluate` and `trainer.predict`
finish on the test split.

Run: ``python examples/mlp_classifier.py [--epochs N] [--steps N]
[--strategy pmap|sharding]``
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from typing_extensions import override

import phalanx as px


# Before JAX creates any array: eight CPU devices on a CPU-only host.
px.fake_cpu_devices(8)

STRATEGIES = {"pmap": px.PmapStrategy, "sharding": px.ShardingStrategy}
BATCH_SIZE = 256


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
        total = f"/{self.epochs}" if self.epochs else ""
        print(
            f"epoch {info.epoch + 1}{total}  "
            f"loss {m['loss']:.4f}  accuracy {m['accuracy']:.3f}  |  "
            f"test loss {m['eval_loss']:.4f}  accuracy {m['eval_accuracy']:.3f}  "
            f"({time.perf_counter() - self.start:.2f} s)"
        )


def make_data(
    rng: np.random.Generator, n: int, prototypes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """n noisy copies of randomly chosen class prototypes, and their labels."""
    labels = rng.integers(0, len(prototypes), size=n)
    images = prototypes[labels] + rng.normal(size=(n, prototypes.shape[1]))
    return images.astype(np.float32), labels.astype(np.int32)


def main(default_strategy: str = "pmap") -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=5, help="passes over the data")
    parser.add_argument("--steps", type=int, help="stop after this many updates")
    parser.add_argument(
        "--strategy", choices=sorted(STRATEGIES), default=default_strategy
    )
    args = parser.parse_args()
    epochs = None if args.steps else args.epochs

    # Ten "digits": sparse random strokes (20% of the pixels) of height 0.35,
    # each image one of them plus unit Gaussian noise on every pixel.
    rng = np.random.default_rng(0)
    prototypes = 0.35 * (rng.uniform(size=(10, 784)) < 0.2)
    x_train, y_train = make_data(rng, 4096, prototypes)
    x_test, y_test = make_data(rng, 1024, prototypes)
    train = px.data.ArrayLoader((x_train, y_train), BATCH_SIZE, seed=0)
    test = px.data.ArrayLoader((x_test, y_test), BATCH_SIZE, shuffle=False)

    strategy = STRATEGIES[args.strategy]()
    n = strategy.num_devices
    print(f"{type(strategy).__name__} on {n} {jax.devices()[0].platform} devices")
    print(
        f"MLP 784-256-128-10, {len(x_train)} train / {len(x_test)} test examples, "
        f"batch {BATCH_SIZE} ({BATCH_SIZE // n} per device)"
    )
    model = px.models.MLP(784, 10, hidden=(256, 128), key=jax.random.key(0))
    trainer = px.DataParallelTrainer(
        model,
        optax.adam(1e-3),
        strategy=strategy,
        loss="cross_entropy",
        callbacks=[PrintProgress(epochs)],
        progress=False,  # PrintProgress is this script's display
    )
    trainer.fit(train, epochs=epochs, steps=args.steps, eval_data=test)

    results = trainer.evaluate(test)
    print(f"final test loss {results['loss']:.4f}, accuracy {results['accuracy']:.3f}")
    predicted = jnp.argmax(trainer.predict(x_test[:12]), axis=-1)
    print(f"predicted {np.asarray(predicted).tolist()}")
    print(f"true      {y_test[:12].tolist()}")


if __name__ == "__main__":
    main()
