"""Gradient accumulation is exact: same parameters, a quarter of the memory.

`px.AccumulatingStrategy(px.PmapStrategy(), microbatches=4)` has each device
split its slice of the batch into four microbatches, add up their gradient
sums in a local `jax.lax.scan`, and all-reduce once per update. Sums are
divided once by the global number of examples, so the update is the one of
the whole batch, even for a ragged last batch (1000 examples in batches of
256: the last has 232, padded with zero-weight examples).

This script trains the same model on the same data and seed three ways (one
device, eight devices, eight devices x four microbatches) and prints how far
the parameters drift apart: float summation order only, about 1e-7.

Run: ``python examples/gradient_accumulation.py [--epochs N] [--steps N]``
"""

import argparse

import equinox as eqx
import jax
import numpy as np
import optax

import phalanx as px


# Before JAX creates any array: eight CPU devices on a CPU-only host.
px.fake_cpu_devices(8)


def max_abs_difference(a: eqx.Module, b: eqx.Module) -> float:
    """The largest elementwise difference between two models' parameters."""
    # On the host: the models live on different sets of devices.
    a, b = jax.device_get(eqx.filter((a, b), eqx.is_inexact_array))
    diffs = jax.tree.map(lambda x, y: np.max(np.abs(x - y)), a, b)
    return max(float(d) for d in jax.tree.leaves(diffs))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=3, help="passes over the data")
    parser.add_argument("--steps", type=int, help="stop after this many updates")
    args = parser.parse_args()
    epochs = None if args.steps else args.epochs

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 64)).astype(np.float32)
    y = (x[:, :10].argmax(axis=1)).astype(np.int32)
    model = px.models.MLP(64, 10, hidden=(128,), key=jax.random.key(0))

    everywhere = px.PmapStrategy()  # every local device
    n = everywhere.num_devices
    strategies = {
        "1 device": px.PmapStrategy(devices=1),
        f"{n} devices": everywhere,
        f"{n} devices x 4 microbatches": px.AccumulatingStrategy(
            everywhere, microbatches=4
        ),
    }
    print(f"{'':<26}  per device  at a time  loss per epoch")
    trained = {}
    for name, strategy in strategies.items():
        # SGD with momentum: adam divides by sqrt(v) and so blows float
        # rounding in near-zero gradients (dead ReLUs) up to ~1e-5.
        trainer = px.DataParallelTrainer(
            model,
            optax.sgd(0.1, momentum=0.9),
            strategy=strategy,
            seed=0,
            progress=False,  # each run's losses are one row of the table below
        )
        # The same shuffled order for each run: a fresh loader with the same seed.
        # 1000 examples in batches of 256: the last is padded with zero weights.
        data = px.data.ArrayLoader((x, y), batch_size=256, seed=0)
        trainer.fit(data, epochs=epochs, steps=args.steps)
        trained[name] = trainer.model
        per_device = 256 // strategy.num_devices
        at_a_time = 256 // strategy.batch_multiple  # per device per microbatch
        losses = "  ".join(f"{h['loss']:.6f}" for h in trainer.history)
        print(f"{name:<26}  {per_device:>10}  {at_a_time:>9}  {losses}")

    reference, *others = trained
    for name in others:
        difference = max_abs_difference(trained[reference], trained[name])
        print(f"max |params({reference}) - params({name})| = {difference:.2e}")


if __name__ == "__main__":
    main()
