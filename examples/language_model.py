"""A decoder-only language model built from phalanx's own blocks, fast on a TPU.

`Decoder` is GPT-2-shaped: token and position embeddings, a stack of
`px.models.TransformerBlock`s (pre-norm causal self-attention with one fused
query/key/value projection, then an MLP), a final norm and the token
embedding reused as the output layer. ``--size gpt2`` is GPT-2 small (124 M
parameters: width 768, 12 layers of 12 heads, 50,304 tokens, 1,024
positions), trained in bfloat16 (``precision="bf16"``: float32 master
weights); ``--size tiny`` (the default) trains in a few seconds on a CPU.

What makes it fast on a TPU, each measured on a v5e (GPT-2 small, batch 8,
1,024 tokens): attention by `px.models.dot_product_attention`, which runs
JAX's Pallas splash kernel there (XLA's attention ran out of memory at this
batch); the blocks a `px.models.Stacked(unroll=True)` (84 → 66 ms a step);
the token embedding looked up for the whole sequence at once (a lookup per
position, `jax.vmap(eqx.nn.Embedding)`, makes its gradient a scatter XLA
runs one position at a time on a TPU: 29 ms of a 75 ms step of a smaller
model). ``benchmarks/tpu.sh`` measures it against a hand-written loop.

It trains on ``data/phalanx.txt`` (bytes as tokens) and prints the loss.

Run: ``python examples/language_model.py [--size tiny|gpt2] [--steps N]
[--batch N] [--seq N]``
"""

import argparse
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

import phalanx as px


# Before JAX creates any array: eight CPU devices on a CPU-only host.
px.fake_cpu_devices(8)

CORPUS = pathlib.Path(__file__).resolve().parent / "data" / "phalanx.txt"
# width, layers, heads, vocab (a multiple of 128: GPT-2's 50,257 padded), seq
SIZES = {
    "tiny": dict(width=64, layers=2, heads=4, vocab=256, seq=128),
    "gpt2": dict(width=768, layers=12, heads=12, vocab=50304, seq=1024),
}


class Decoder(eqx.Module):
    """Token ids (seq,) to next-token logits (seq, vocab), one sequence."""

    tokens: eqx.nn.Embedding
    positions: eqx.nn.Embedding
    blocks: px.models.Stacked
    norm: eqx.nn.LayerNorm

    def __init__(
        self, *, width: int, layers: int, heads: int, vocab: int, seq: int,
        key: PRNGKeyArray,
    ):  # fmt: skip
        tokens, positions, blocks = jax.random.split(key, 3)
        # GPT-2's initial scales: the logits start near uniform.
        normal = jax.random.normal
        self.tokens = eqx.nn.Embedding(weight=0.02 * normal(tokens, (vocab, width)))
        self.positions = eqx.nn.Embedding(weight=0.01 * normal(positions, (seq, width)))
        self.blocks = px.models.Stacked(
            lambda key: px.models.TransformerBlock(width, heads, key=key),
            layers,
            key=blocks,
            unroll=True,
        )
        self.norm = eqx.nn.LayerNorm(width)

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        # The whole sequence's rows at once (see the module's docstring).
        table = self.tokens.weight
        x = table[ids] + self.positions.weight[: ids.shape[0]]
        x = jax.vmap(self.norm)(self.blocks(x))
        return x @ table.T


def next_token_loss(
    logits: Float[Array, "batch seq vocab"], targets: Int[Array, "batch seq"]
) -> Float[Array, " batch"]:
    """Cross-entropy of each next token, averaged over the positions."""
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.mean(per_token, axis=-1)


def flops_per_token(width: int, layers: int, vocab: int, seq: int, **_) -> float:
    """Model FLOPs a token in training (forward and backward: 6 a weight;
    causal attention, half its scores): the MFU's numerator, as PaLM counts."""
    dense = 12 * layers * width**2 + width * vocab
    return 6 * dense + 6 * layers * seq * width


def batches(batch: int, seq: int, vocab: int) -> px.data.ArrayLoader:
    """Windows of the corpus' bytes (repeated to fill a batch), each with the
    tokens after it."""
    text = np.frombuffer(CORPUS.read_bytes(), np.uint8).astype(np.int32)
    text = np.tile(text, -(-(batch * 2 + seq + 1) // len(text)))
    starts = np.arange(0, len(text) - seq - 1, seq // 2)
    windows = text[starts[:, None] + np.arange(seq + 1)] % vocab
    return px.data.ArrayLoader((windows[:, :-1], windows[:, 1:]), batch, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=60, help="updates to make")
    parser.add_argument("--batch", type=int, default=16, help="sequences a step")
    parser.add_argument("--seq", type=int, help="tokens a sequence (the size's)")
    args = parser.parse_args()
    size = dict(SIZES[args.size])
    size["seq"] = args.seq or size["seq"]
    model = Decoder(**size, key=jax.random.key(0))
    parameters = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    print(f"Decoder {args.size}: {parameters:,} parameters, {size}")
    trainer = px.DataParallelTrainer(
        model,
        optax.adamw(optax.warmup_cosine_decay_schedule(0, 3e-3, 10, args.steps)),
        loss=next_token_loss,
        metrics=(),
        precision="bf16",
        progress=False,
    )
    data = batches(args.batch, size["seq"], size["vocab"])
    trainer.fit(data, steps=args.steps)
    losses = trainer.history["loss"]
    print(f"loss {losses[0]:.4f} in the first epoch, {losses[-1]:.4f} in the last")


if __name__ == "__main__":
    main()
