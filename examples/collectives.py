"""Collectives across devices: psum and all_gather, directly and inside a loss.

Part 1 runs a per-device program with `jax.shard_map` over a strategy's mesh:
each of the eight devices holds one number, `jax.lax.psum` all-reduces them
(every device gets the sum) and `jax.lax.all_gather` hands every device all
of them.

Part 2 subclasses `px.DataParallelTrainer` for a CLIP-style contrastive loss.
Under `px.PmapStrategy` the loss runs on each device's slice of the batch, so
`jax.lax.all_gather` collects the other devices' embeddings to serve as
negatives: every example is contrasted with the whole global batch. Gradients
flow back through the gather to the devices that made those embeddings, so
training on eight devices matches training on one device with the whole
batch, which the script checks. The two views come from a dict
`px.data.ArrayLoader`, reshuffled every epoch.

Run: ``python examples/collectives.py [--epochs N] [--steps N]``
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.losses
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree
from typing_extensions import override

import phalanx as px


# Before JAX creates any array: eight CPU devices on a CPU-only host.
px.fake_cpu_devices(8)


# ------------------------------------------------ part 1: collectives by hand


def show_collectives(strategy: px.PmapStrategy) -> None:
    axis = strategy.axis_name
    n = strategy.num_devices
    x = jax.device_put(np.arange(1, n + 1, dtype=np.float32), strategy.batch_sharding)

    def per_device(x: Float[Array, "1"]):
        # x is this device's slice: one number.
        total = jax.lax.psum(x, axis)  # the sum, on every device
        gathered = jax.lax.all_gather(x, axis, tiled=True)  # all n, on every device
        return jax.lax.axis_index(axis)[None], x, total, gathered[None]

    results = jax.shard_map(
        per_device, mesh=strategy.mesh, in_specs=P(axis), out_specs=P(axis)
    )(x)
    print(f"part 1: jax.shard_map over {n} devices, axis {axis!r}")
    for index, value, total, gathered in zip(*jax.device_get(results), strict=True):
        print(
            f"  device {index}: holds {value:.0f}  psum -> {total:.0f}  "
            f"all_gather -> {gathered.astype(int).tolist()}"
        )


# ------------------------------------------- part 2: a loss with all_gather


class TwoTower(eqx.Module):
    """Embeds the two views of one example, each with its own encoder."""

    left: px.models.MLP
    right: px.models.MLP

    def __init__(self, in_size: int, out_size: int, *, key: PRNGKeyArray):
        left, right = jax.random.split(key)
        self.left = px.models.MLP(in_size, out_size, hidden=(64,), key=left)
        self.right = px.models.MLP(in_size, out_size, hidden=(64,), key=right)

    def __call__(self, views: Float[Array, "2 in"]) -> Float[Array, "2 out"]:
        return jnp.stack([self.left(views[0]), self.right(views[1])])


def _axis_bound(axis: str) -> bool:
    """Whether this code runs inside a per-device program over `axis`."""
    try:
        jax.lax.axis_index(axis)
    except NameError:
        return False
    return True


class ContrastiveTrainer(px.DataParallelTrainer[TwoTower]):
    """InfoNCE over the global batch: each left view must pick its right view.

    A batch is what ``px.data.ArrayLoader({"left": ..., "right": ...})``
    yields: a dict of the two views plus the loader's ``"sample_weight"``
    (which the default `sample_weight` hook reads). `split_batch` stacks the
    views into one model input per example and leaves no targets: the partner
    of example i is example i of the other view.
    """

    temperature = 0.1

    def __init__(
        self, model: TwoTower, optimizer: optax.GradientTransformation, **kwargs
    ):
        # The loss goes in as loss= rather than as an override of loss(): the
        # default loss="cross_entropy" would also check targets as class labels.
        super().__init__(model, optimizer, loss=self.info_nce, **kwargs)

    @override
    def split_batch(self, batch: PyTree) -> tuple[PyTree, PyTree]:
        # Host-side NumPy, like the batch itself: the trainer checks and
        # shards the result.
        return np.stack([batch["left"], batch["right"]], axis=1), None

    def info_nce(
        self, outputs: Float[Array, "batch 2 dim"], targets: None
    ) -> Float[Array, " batch"]:
        del targets
        logits, labels = self._logits_and_labels(outputs)
        return optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels)

    @override
    def metrics(
        self, outputs: Float[Array, "batch 2 dim"], targets: None
    ) -> dict[str, Float[Array, " batch"]]:
        del targets
        logits, labels = self._logits_and_labels(outputs)
        return {"match": (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)}

    def _logits_and_labels(
        self, outputs: Float[Array, "batch 2 dim"]
    ) -> tuple[Float[Array, "batch everyone"], Int[Array, " batch"]]:
        embeddings = outputs / jnp.linalg.norm(outputs, axis=-1, keepdims=True)
        left, right = embeddings[:, 0], embeddings[:, 1]
        labels = jnp.arange(left.shape[0])
        axis = self.strategy.axis_name
        # Under PmapStrategy the loss sees one device's slice. Where the device
        # axis is unbound (ShardingStrategy: one program over the global batch)
        # the slice already is the whole batch, and there is nothing to gather.
        if _axis_bound(axis):
            # Everyone's right views in device order: device d's partners sit at
            # rows d * n ... (d + 1) * n - 1 of the gathered array.
            right = jax.lax.all_gather(right, axis, tiled=True)
            labels = labels + jax.lax.axis_index(axis) * left.shape[0]
        return left @ right.T / self.temperature, labels


def make_views(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two noisy linear views (16 features each) of n hidden 8-d vectors."""
    hidden = rng.normal(size=(n, 8))
    a, b = rng.normal(size=(2, 8, 16))
    left = hidden @ a + 0.3 * rng.normal(size=(n, 16))
    right = hidden @ b + 0.3 * rng.normal(size=(n, 16))
    return left.astype(np.float32), right.astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=5, help="passes over the data")
    parser.add_argument("--steps", type=int, help="stop after this many updates")
    args = parser.parse_args()
    epochs = None if args.steps else args.epochs

    everywhere = px.PmapStrategy()  # every local device
    show_collectives(everywhere)

    left, right = make_views(np.random.default_rng(0), 1024)
    model = TwoTower(16, 16, key=jax.random.key(0))
    print("part 2: contrastive loss, negatives all_gather-ed from every device")
    trained = []
    for strategy in (everywhere, px.PmapStrategy(devices=1)):
        # A fresh loader with the same seed, so both runs see the same
        # shuffled batches. Padding would break the exactness of this loss:
        # a zero-weight padding row adds no loss of its own, but its embedding
        # would still be all_gather-ed as a negative for every real example.
        # So the batch size divides the data (1024 = 8 x 128) and
        # drop_last=True keeps that true if either number changes.
        data = px.data.ArrayLoader(
            {"left": left, "right": right}, batch_size=128, seed=0, drop_last=True
        )
        trainer = ContrastiveTrainer(model, optax.adam(3e-3), strategy=strategy)
        trainer.fit(data, epochs=epochs, steps=args.steps)
        trained.append(jax.device_get(eqx.filter(trainer.model, eqx.is_array)))
        first, last = trainer.history[0], trainer.history[-1]
        n = strategy.num_devices
        print(
            f"  {n} device(s), {data.batch_size // n:>3} examples each: "
            f"loss {first['loss']:.4f} -> {last['loss']:.4f}, partner found among "
            f"{data.batch_size}: {first['match']:.1%} -> {last['match']:.1%}"
        )
    diffs = jax.tree.map(lambda a, b: np.abs(a - b).max(), *trained)
    print(
        f"  max |params({everywhere.num_devices} devices) - params(1 device)| = "
        f"{max(jax.tree.leaves(diffs)):.2e}"
    )


if __name__ == "__main__":
    main()
