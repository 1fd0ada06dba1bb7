"""A GAN on a ring of eight Gaussians: two optimizers in one step.

The generator maps 2-D noise to points; the discriminator scores points as
real or generated. One trainer trains both, each with its own optax
optimizer on its own loss (``optimizer={"generator": ..., "discriminator":
...}`` and the `param_groups` hook): every step, each group takes the
gradient of its own loss with the other group's parameters held fixed,
and both gradients cross the devices in one reduction, here under a
`ShardingStrategy` on eight devices.

The script prints how far generated points lie from the nearest of the
eight modes, and how many modes they reach, before and after training.

Run: ``python examples/gan.py [--steps N]``
"""

import argparse

import equinox as eqx
import jax
import numpy as np
import optax
from jaxtyping import Array, Float, PRNGKeyArray
from typing_extensions import override

import phalanx as px


# Before JAX creates any array: eight CPU devices on a CPU-only host.
px.fake_cpu_devices(8)

MODES = 2.0 * np.stack(
    [np.cos(np.arange(8) * np.pi / 4), np.sin(np.arange(8) * np.pi / 4)], axis=-1
).astype(np.float32)  # on a circle of radius 2
SPREAD = 0.05  # each mode's standard deviation
NOISE = 2  # the generator's input
BATCH_SIZE = 256


class Gan(eqx.Module):
    """A generator and its discriminator; called on noise, it generates."""

    generator: eqx.nn.MLP
    discriminator: eqx.nn.MLP

    def __init__(self, *, key: PRNGKeyArray):
        g, d = jax.random.split(key)
        self.generator = eqx.nn.MLP(NOISE, 2, 64, 2, activation=jax.nn.relu, key=g)
        self.discriminator = eqx.nn.MLP(2, "scalar", 64, 2, key=d)

    def __call__(self, noise: Float[Array, " noise"]) -> Float[Array, " 2"]:
        return self.generator(noise)


class GanTrainer(px.DataParallelTrainer[Gan]):
    """Batches are (noise, real points); the model's outputs are generated
    points."""

    @override
    def param_groups(self, model):
        # The model with each group's name where the parameters it trains are.
        return eqx.tree_at(
            lambda m: (m.generator, m.discriminator),
            model,
            ("generator", "discriminator"),
        )

    @override
    def loss(self, model, outputs, targets):
        real = jax.vmap(model.discriminator)(targets)
        fake = jax.vmap(model.discriminator)(outputs)
        # The discriminator learns to tell them apart; the generator, to be
        # taken for real (the non-saturating loss).
        discriminator = jax.nn.softplus(-real) + jax.nn.softplus(fake)
        generator = jax.nn.softplus(-fake)
        return {"generator": generator, "discriminator": discriminator}

    @override
    def metrics(self, outputs, targets):
        return {}  # not a classifier: no accuracy


def real_points(n: int, rng: np.random.Generator) -> np.ndarray:
    modes = MODES[rng.integers(0, len(MODES), size=n)]
    return (modes + SPREAD * rng.normal(size=(n, 2))).astype(np.float32)


def quality(points: np.ndarray) -> tuple[float, int]:
    """The mean distance of `points` to the nearest mode, and the modes that
    at least 2% of them lie within 3 standard deviations of."""
    distances = np.linalg.norm(points[:, None, :] - MODES[None], axis=-1)
    nearest = distances.argmin(axis=1)
    close = distances.min(axis=1) < 3 * SPREAD
    reached = sum(np.mean(close & (nearest == i)) >= 0.02 for i in range(len(MODES)))
    return float(distances.min(axis=1).mean()), int(reached)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3000, help="updates to make")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    n = 64 * BATCH_SIZE
    noise = rng.normal(size=(n, NOISE)).astype(np.float32)
    data = px.data.ArrayLoader((noise, real_points(n, rng)), BATCH_SIZE, seed=0)
    probe = rng.normal(size=(2048, NOISE)).astype(np.float32)

    trainer = GanTrainer(
        Gan(key=jax.random.key(0)),
        {
            "generator": optax.adam(1e-3, b1=0.5),
            "discriminator": optax.adam(1e-3, b1=0.5),
        },
        strategy=px.ShardingStrategy(),
        progress=False,
    )
    print(f"{trainer.strategy.num_devices} devices, groups: generator, discriminator")
    distance, reached = quality(np.asarray(trainer.predict(probe)))
    print(f"before: distance to the nearest mode {distance:.3f}, modes {reached}")
    trainer.fit(data, steps=args.steps)
    last = trainer.history[-1]
    print(
        f"losses: generator {last['generator_loss']:.3f}, "
        f"discriminator {last['discriminator_loss']:.3f}"
    )
    distance, reached = quality(np.asarray(trainer.predict(probe)))
    print(f"after: distance to the nearest mode {distance:.3f}, modes {reached}")


if __name__ == "__main__":
    main()
