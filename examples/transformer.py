"""A small decoder-only transformer on a mesh: data × fsdp × tensor.

A character-level language model trained on ``data/phalanx.txt`` (a short
text written for this project) under ``px.MeshStrategy(data=2, fsdp=2,
tensor=2)`` on eight devices:

- the batch is split over ``data`` × ``fsdp`` (four ways);
- the blocks are a `px.models.Stacked` stack: stored with one leading layer
  axis and run with `jax.lax.scan`, so each layer's parameters are gathered
  inside the loop, one layer at a time;
- sharding rules split the attention and MLP weights Megatron-style over
  ``tensor`` (query/key/value and the MLP's first layer by their outputs,
  the attention's output projection and the MLP's second layer by their
  inputs), and every weight also over ``fsdp``;
- the model is built in its shards with `px.sharded_model`: no array of it
  is ever whole on one device.

The script prints where the weights went, the loss as it falls, and a few
characters the model writes after training.

Run: ``python examples/transformer.py [--steps N] [--layers N]``
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

CORPUS = pathlib.Path(__file__).resolve().parent / "data" / "phalanx.txt"
CONTEXT = 64  # characters the model sees at once
WIDTH = 64
HEADS = 4
BATCH_SIZE = 32

# One rule per weight, its dimensions as stored: a stacked weight's first
# axis is its layers' (never split here), then (out, in) as in eqx.nn.Linear.
RULES = [
    (r"blocks\.layers\.attention\.(query|key|value)_proj\.weight",
     (None, "tensor", "fsdp")),
    (r"blocks\.layers\.attention\.output_proj\.weight", (None, "fsdp", "tensor")),
    (r"blocks\.layers\.up\.weight", (None, "tensor", "fsdp")),
    (r"blocks\.layers\.down\.weight", (None, "fsdp", "tensor")),
]  # fmt: skip


class Block(eqx.Module):
    """Pre-norm causal self-attention, then a pre-norm MLP, each residual."""

    attention_norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    mlp_norm: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray):
        attention, up, down = jax.random.split(key, 3)
        self.attention_norm = eqx.nn.LayerNorm(WIDTH)
        self.attention = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=attention)
        self.mlp_norm = eqx.nn.LayerNorm(WIDTH)
        self.up = eqx.nn.Linear(WIDTH, 4 * WIDTH, key=up)
        self.down = eqx.nn.Linear(4 * WIDTH, WIDTH, key=down)

    def __call__(self, x: Float[Array, "seq width"]) -> Float[Array, "seq width"]:
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        h = jax.vmap(self.attention_norm)(x)
        x = x + self.attention(h, h, h, mask=causal)
        h = jax.vmap(self.mlp_norm)(x)
        return x + jax.vmap(lambda v: self.down(jax.nn.gelu(self.up(v))))(h)


class Transformer(eqx.Module):
    """Characters in, one distribution over the next character per position."""

    embed: eqx.nn.Embedding
    position: Float[Array, "context width"]
    blocks: px.models.Stacked
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, vocab: int, layers: int, key: PRNGKeyArray):
        embed, position, blocks, unembed = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(vocab, WIDTH, key=embed)
        self.position = 0.02 * jax.random.normal(position, (CONTEXT, WIDTH))
        self.blocks = px.models.Stacked(Block, layers, key=blocks)
        self.norm = eqx.nn.LayerNorm(WIDTH)
        self.unembed = eqx.nn.Linear(WIDTH, vocab, key=unembed)

    def __call__(self, chars: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        x = jax.vmap(self.embed)(chars) + self.position[: chars.shape[0]]
        x = self.blocks(x)
        return jax.vmap(lambda v: self.unembed(self.norm(v)))(x)


def next_char_loss(
    logits: Float[Array, "batch seq vocab"], targets: Int[Array, "batch seq"]
) -> Float[Array, " batch"]:
    """Cross-entropy of each next character, averaged over the positions."""
    per_char = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.mean(per_char, axis=-1)


class PrintLoss(px.Callback):
    """Prints the loss of the first step and of every `every`-th."""

    def __init__(self, every: int):
        self.every = every

    @override
    def on_step_end(self, info: px.StepInfo) -> None:
        if info.step == 1 or info.step % self.every == 0:
            print(f"step {info.step:4d}  loss {info.metrics['loss']:.4f}")


def windows(text: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every window of CONTEXT characters, and the characters after each."""
    starts = np.arange(len(text) - CONTEXT)
    index = starts[:, None] + np.arange(CONTEXT + 1)
    chunks = text[index]
    return chunks[:, :-1], chunks[:, 1:]


def show_layout(model: Transformer) -> None:
    """Each weight's layout, and the shape one device holds of it."""
    layers = model.blocks.layers
    named = {
        "attention query": layers.attention.query_proj.weight,
        "attention output": layers.attention.output_proj.weight,
        "mlp up": layers.up.weight,
        "mlp down": layers.down.weight,
        "embedding": model.embed.weight,
    }
    for name, array in named.items():
        shard = array.addressable_shards[0].data.shape
        print(
            f"  {name:<17} {str(tuple(array.shape)):<15} "
            f"{str(array.sharding.spec):<32} per device {tuple(shard)}"
        )


def generate(model: Transformer, prompt: np.ndarray, n: int) -> np.ndarray:
    """`n` characters after `prompt`, each the most likely next one."""

    @jax.jit
    def next_char(window: Int[Array, " seq"]) -> Int[Array, ""]:
        return jnp.argmax(model(window)[-1])

    text = list(prompt[-CONTEXT:])
    for _ in range(n):
        text.append(int(next_char(jnp.asarray(text[-CONTEXT:]))))
    return np.asarray(text[CONTEXT:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="updates to make")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    args = parser.parse_args()

    text = CORPUS.read_text()
    alphabet = sorted(set(text))
    encode = {char: i for i, char in enumerate(alphabet)}
    codes = np.asarray([encode[char] for char in text], np.int32)
    inputs, targets = windows(codes)
    data = px.data.ArrayLoader((inputs, targets), BATCH_SIZE, seed=0)

    strategy = px.MeshStrategy(data=2, fsdp=2, tensor=2, rules=RULES)
    print(
        f"MeshStrategy on {strategy.num_devices} devices, mesh "
        f"{dict(strategy.mesh.shape)}"
    )
    model = px.sharded_model(
        lambda key: Transformer(len(alphabet), args.layers, key),
        strategy,
        key=jax.random.key(0),
    )
    print(
        f"{len(text)} characters ({len(alphabet)} distinct), {len(inputs)} "
        f"windows of {CONTEXT}; {args.layers} blocks of width {WIDTH}, "
        f"{sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))} "
        "parameters"
    )
    trainer = px.DataParallelTrainer(
        model,
        optax.adamw(3e-3),
        strategy=strategy,
        loss=next_char_loss,
        callbacks=[PrintLoss(every=max(1, args.steps // 10))],
        progress=False,  # PrintLoss is this script's display
    )
    print("where the weights are (layer axis, then out, in):")
    show_layout(trainer.model)
    trainer.fit(data, steps=args.steps)

    prompt = codes[:CONTEXT]
    written = generate(trainer.model, prompt, 60)
    print(f"prompt:  {''.join(alphabet[c] for c in prompt)!r}")
    print(f"written: {''.join(alphabet[c] for c in written)!r}")


if __name__ == "__main__":
    main()
