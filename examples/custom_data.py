"""Train on batches from your own Python code: a generator function.

The trainer takes any re-iterable of NumPy batches, so the data can come from
a plain generator (reading files, augmenting, decoding, ...). A generator is
used up after one pass, so a tiny `Reiterable` wrapper calls the generator
function afresh for every epoch. The data are the UCI handwritten digits
shipped with phalanx (`px.data.load_digits`, 1,437 train / 360 test 8×8
images); the model a 64-128-10 `px.models.MLP` on eight devices.

Run: ``python examples/custom_data.py [--epochs N] [--steps N]``
"""

import argparse
from collections.abc import Callable, Iterator

import jax
import numpy as np
import optax
from typing_extensions import override

import phalanx as px


# Before JAX creates any array: eight CPU devices on a CPU-only host.
px.fake_cpu_devices(8)

BATCH_SIZE = 128
Batch = tuple[np.ndarray, np.ndarray]


class Reiterable:
    """Makes a generator function re-iterable: each pass calls it afresh."""

    def __init__(self, generator_fn: Callable[[], Iterator[Batch]]):
        self.generator_fn = generator_fn

    def __iter__(self) -> Iterator[Batch]:
        return self.generator_fn()


class PrintEpochs(px.Callback):
    """Prints one line per epoch: training and test loss and accuracy."""

    def __init__(self, epochs: int | None):
        self.epochs = epochs

    @override
    def on_epoch_end(self, info: px.StepInfo) -> None:
        m = info.metrics
        total = f"/{self.epochs}" if self.epochs else ""
        print(
            f"epoch {info.epoch + 1}{total}  loss {m['loss']:.4f}  "
            f"accuracy {m['accuracy']:.3f}  |  test loss {m['eval_loss']:.4f}  "
            f"accuracy {m['eval_accuracy']:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=10, help="passes over the data")
    parser.add_argument("--steps", type=int, help="stop after this many updates")
    args = parser.parse_args()
    epochs = None if args.steps else args.epochs

    (x_train, y_train), (x_test, y_test) = px.data.load_digits()
    rng = np.random.default_rng(0)

    def train_batches() -> Iterator[Batch]:
        """One shuffled pass; any Python code could produce these batches."""
        order = rng.permutation(len(x_train))
        for start in range(0, len(order), BATCH_SIZE):
            rows = order[start : start + BATCH_SIZE]
            # The last batch is shorter (1437 = 11 × 128 + 29): the trainer
            # pads it with zero-weight examples, so its update stays exact.
            yield x_train[rows], y_train[rows]

    def test_batches() -> Iterator[Batch]:
        for start in range(0, len(x_test), BATCH_SIZE):
            yield x_test[start : start + BATCH_SIZE], y_test[start : start + BATCH_SIZE]

    strategy = px.ShardingStrategy()
    print(
        f"MLP 64-128-10 on {strategy.num_devices} {jax.devices()[0].platform} "
        f"devices, digits: {len(x_train)} train / {len(x_test)} test, "
        f"batch {BATCH_SIZE}"
    )
    model = px.models.MLP(64, 10, hidden=(128,), key=jax.random.key(0))
    trainer = px.DataParallelTrainer(
        model,
        optax.adam(1e-2),
        strategy=strategy,
        callbacks=[PrintEpochs(epochs)],
        progress=False,  # PrintEpochs is this script's display
    )
    trainer.fit(
        Reiterable(train_batches),
        epochs=epochs,
        steps=args.steps,
        eval_data=Reiterable(test_batches),
    )
    results = trainer.evaluate(Reiterable(test_batches))
    print(f"final test loss {results['loss']:.4f}, accuracy {results['accuracy']:.3f}")


if __name__ == "__main__":
    main()
