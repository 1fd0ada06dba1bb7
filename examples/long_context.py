"""A causal transformer on sequences of 4,096 characters, each split over
four devices: ``px.MeshStrategy(data=2, context=4)``.

The text is this project's own guides (``docs/guides/*.md``, about 300,000
characters), cut into windows of ``--seq`` characters. On eight devices:

- the batch is split over ``data`` (two examples at a time, one each);
- each example's sequence is split over ``context`` (``sequence_dims``
  names the dimension: 1, of the tokens and of the next tokens), so each
  device holds 1,024 positions of one example, and their activations;
- attention is `px.models.dot_product_attention`, which exchanges the keys
  and values round the ``context`` ring (``--attention all_gather``
  gathers them instead) and, causal, gives each device the same work.

First the script prints what one device holds of a step (the compiled
step's temporaries, nothing run) with each example's sequence on one, two
and four devices; then it trains under ``context=4``.

Run: ``python examples/long_context.py [--steps N] [--seq N] [--attention ring]``
"""

import argparse
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray
from typing_extensions import override

import phalanx as px


# Before JAX creates any array: eight CPU devices on a CPU-only host.
px.fake_cpu_devices(8)

GUIDES = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guides"
WIDTH = 32
HEADS = 2
# Tokens and next tokens, of shape (examples, sequence): split dimension 1.
SEQUENCE_DIMS = {"x": 1, "y": 1}


class Block(eqx.Module):
    """Pre-norm causal self-attention, then a pre-norm MLP, each residual."""

    attention_norm: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear
    mlp_norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    implementation: str = eqx.field(static=True)

    def __init__(self, implementation: str, key: PRNGKeyArray):
        qkv, proj, up, down = jax.random.split(key, 4)
        self.attention_norm = eqx.nn.LayerNorm(WIDTH)
        self.qkv = eqx.nn.Linear(WIDTH, 3 * WIDTH, key=qkv)
        self.proj = eqx.nn.Linear(WIDTH, WIDTH, key=proj)
        self.mlp_norm = eqx.nn.LayerNorm(WIDTH)
        self.up = eqx.nn.Linear(WIDTH, 4 * WIDTH, key=up)
        self.down = eqx.nn.Linear(4 * WIDTH, WIDTH, key=down)
        self.implementation = implementation

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        h = jax.vmap(self.attention_norm)(x)
        qkv = jax.vmap(self.qkv)(h).reshape(x.shape[0], 3, HEADS, WIDTH // HEADS)
        attended = px.models.dot_product_attention(
            qkv[:, 0],
            qkv[:, 1],
            qkv[:, 2],
            causal=True,
            implementation=self.implementation,
        )
        x = x + jax.vmap(self.proj)(attended.reshape(x.shape))
        h = jax.vmap(self.mlp_norm)(x)
        return x + jax.vmap(lambda v: self.down(jax.nn.gelu(self.up(v))))(h)


class Transformer(eqx.Module):
    """Characters in, one distribution over the next character per position
    (positions as learned embeddings, one per position of the window)."""

    embed: eqx.nn.Embedding
    position: Float[Array, "seq width"]
    blocks: px.models.Stacked
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, vocab: int, seq: int, layers: int, attention: str, key):
        embed, position, blocks, unembed = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(vocab, WIDTH, key=embed)
        self.position = 0.02 * jax.random.normal(position, (seq, WIDTH))
        self.blocks = px.models.Stacked(
            lambda key: Block(attention, key), layers, key=blocks, remat=True
        )
        self.norm = eqx.nn.LayerNorm(WIDTH)
        self.unembed = eqx.nn.Linear(WIDTH, vocab, key=unembed)

    def __call__(self, chars: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(chars) + self.position
        x = self.blocks(x)
        return jax.vmap(lambda v: self.unembed(self.norm(v)))(x)


def next_char_loss(
    logits: Float[Array, "batch seq vocab"], targets: Int[Array, "batch seq"]
) -> Float[Array, " batch"]:
    """Cross-entropy of each next character, averaged over the positions."""
    per_char = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.mean(per_char, axis=-1)


class PrintLoss(px.Callback):
    """Prints the loss of each step."""

    @override
    def on_step_end(self, info: px.StepInfo) -> None:
        print(f"step {info.step:3d}  loss {info.metrics['loss']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="updates to make")
    parser.add_argument("--seq", type=int, default=4096, help="characters a window")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument(
        "--attention", default="ring", choices=["ring", "all_gather"], help="how"
    )
    args = parser.parse_args()

    text = "\n".join(p.read_text() for p in sorted(GUIDES.glob("*.md")))
    alphabet = sorted(set(text))
    codes = np.asarray([alphabet.index(c) for c in text], np.int32)
    windows = len(codes) // (args.seq + 1)
    chunks = codes[: windows * (args.seq + 1)].reshape(windows, args.seq + 1)
    data = px.data.ArrayLoader((chunks[:, :-1], chunks[:, 1:]), 2, seed=0)
    print(
        f"{len(text):,} characters ({len(alphabet)} distinct): {windows} windows "
        f"of {args.seq}; {args.layers} blocks of width {WIDTH}, {args.attention} "
        "attention"
    )

    def trainer(strategy: px.MeshStrategy, **kwargs) -> px.DataParallelTrainer:
        model = Transformer(
            len(alphabet), args.seq, args.layers, args.attention, jax.random.key(0)
        )
        return px.DataParallelTrainer(
            model,
            optax.adamw(3e-3),
            strategy=strategy,
            loss=next_char_loss,
            progress=False,
            **kwargs,
        )

    # One example on each `data` position, its sequence on `context` devices.
    batch = (chunks[:2, :-1], chunks[:2, 1:])
    print("what one device holds of a step (compiled, nothing run):")
    for context in (1, 2, 4):
        strategy = px.MeshStrategy(
            2 * context, data=2, context=context, sequence_dims=SEQUENCE_DIMS
        )
        step = trainer(strategy).summary(batch).step
        assert step is not None
        print(
            f"  context={context}: {args.seq // context:>5} positions a device, "
            f"temporaries {step.temporaries / 2**20:6.1f} MiB, peak "
            f"{step.peak / 2**20:6.1f} MiB"
        )

    strategy = px.MeshStrategy(data=2, context=4, sequence_dims=SEQUENCE_DIMS)
    print(
        f"training on {strategy.num_devices} devices, mesh {dict(strategy.mesh.shape)}"
    )
    trainer(strategy, callbacks=[PrintLoss()]).fit(data, steps=args.steps)


if __name__ == "__main__":
    main()
