"""A ~19 M-parameter decoder trained on one device at 16k, 32k and 64k tokens
a sequence (batch 1), each step's time and the device's peak memory printed.

On a TPU, `px.models.dot_product_attention` runs JAX's Pallas splash kernel
for the whole sequence: the score matrix is never built (XLA's attention
needs 48.9 GB at 16k tokens, batch 4, 8 heads). The rest of the memory is
kept small by `px.models.Stacked(remat=True)`: each block's activations are
recomputed in the backward pass, so a step keeps one ``seq × width`` input a
block and one block's activations at a time. bfloat16 compute on a TPU is
``precision="bf16"`` (float32 master weights and optimizer state).

The model: bytes as tokens (256), an embedding plus sinusoidal positions
(a learned table would be 64k × 512 = 33.5 M parameters at 64k tokens, more
than the rest of the model, and would tie the model to one length), six
``px.models.TransformerBlock(512, heads=8, causal=True)`` (heads of 64), a
final norm and an unembedding. The text is this repository's own
(``docs/**/*.md`` and ``src/**/*.py`` as bytes, repeated where a window is
longer).

One device (``px.ShardingStrategy(devices=1)``): on a host of one chip the
step is that chip's program, where the kernel runs (on a host of several,
attention traced in the global view over all of them falls back to XLA's,
with a warning: give the process one chip). The sequences run in
increasing order in one process, so the peak
(``memory_stats()['peak_bytes_in_use']``, the process'
high-water mark) printed after each is that of the longest sequence so far.

``--compare-xla SEQ`` trains the same model from the same key on the same
batches twice at SEQ tokens, attention by the kernel
(``implementation="auto"``) and by XLA's (``"xla"``), and prints both final
losses and their difference.

Run: ``python examples/long_sequence.py [--seq 16384,32768,65536] [--steps 5]
[--layers 6] [--width 512] [--heads 8] [--precision auto|bf16|fp32]
[--highest] [--compare-xla SEQ] [--out FILE]``; on a CPU at a tiny size, e.g.
``--seq 256 --steps 2 --layers 1 --width 64``.
"""

import argparse
import json
import logging
import pathlib
import time
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray
from typing_extensions import override

import phalanx as px


ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB = 256  # bytes


class Decoder(eqx.Module):
    """Byte ids (seq,) to next-byte logits (seq, 256), one sequence."""

    tokens: eqx.nn.Embedding
    blocks: px.models.Stacked
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(
        self, *, width: int, layers: int, heads: int,
        implementation: Literal["auto", "xla"],
        key: PRNGKeyArray,
    ):  # fmt: skip
        tokens, blocks, unembed = jax.random.split(key, 3)
        weight = 0.02 * jax.random.normal(tokens, (VOCAB, width))
        self.tokens = eqx.nn.Embedding(weight=weight)
        self.blocks = px.models.Stacked(
            lambda key: px.models.TransformerBlock(
                width, heads, causal=True, implementation=implementation, key=key
            ),
            layers,
            key=blocks,
            remat=True,  # each block recomputed in the backward pass
        )
        self.norm = eqx.nn.LayerNorm(width)
        self.unembed = eqx.nn.Linear(width, VOCAB, key=unembed)

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        table = self.tokens.weight
        # The whole sequence's rows at once: a lookup per position makes the
        # gradient a scatter a TPU runs position by position.
        x = table[ids] + sinusoids(ids.shape[0], table.shape[1]).astype(table.dtype)
        x = self.blocks(x)
        return jax.vmap(lambda v: self.unembed(self.norm(v)))(x)


def sinusoids(seq: int, width: int) -> Float[Array, "seq width"]:
    """The Transformer's fixed positions: sines and cosines of each position
    at `width` / 2 frequencies from 1 to 1/10,000."""
    frequencies = 10_000.0 ** -(
        jnp.arange(width // 2, dtype=jnp.float32) / (width // 2)
    )
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * frequencies
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def next_byte_loss(
    logits: Float[Array, "batch seq vocab"], targets: Int[Array, "batch seq"]
) -> Float[Array, " batch"]:
    """Cross-entropy of each next byte, averaged over the positions."""
    per_byte = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.mean(per_byte, axis=-1)


def windows(seq: int) -> px.data.ArrayLoader:
    """The repository's text as windows of `seq` bytes and the bytes after
    them, one a batch (the text repeated where it is shorter than a window)."""
    files = sorted(ROOT.glob("docs/**/*.md")) + sorted(ROOT.glob("src/**/*.py"))
    text = np.frombuffer(b"\n".join(f.read_bytes() for f in files), np.uint8)
    text = np.tile(text.astype(np.int32), -(-(seq + 1) // len(text)))
    count = len(text) // (seq + 1)
    chunks = text[: count * (seq + 1)].reshape(count, seq + 1)
    return px.data.ArrayLoader((chunks[:, :-1], chunks[:, 1:]), 1, seed=0)


class StepClock(px.Callback):
    """Each step's loss and when the host saw it: reading the loss waits for
    the device, so the times between steps are the device's."""

    def __init__(self) -> None:
        self.start = 0.0
        self.ends: list[float] = []
        self.losses: list[float] = []

    @override
    def on_fit_start(self, info: px.StepInfo) -> None:
        self.start = time.perf_counter()

    @override
    def on_step_end(self, info: px.StepInfo) -> None:
        self.losses.append(float(info.metrics["loss"]))
        self.ends.append(time.perf_counter())


def train(
    args: argparse.Namespace, seq: int, implementation: Literal["auto", "xla"]
) -> dict:
    """`args.steps` steps at `seq` tokens: the numbers of the run."""
    model = Decoder(
        width=args.width,
        layers=args.layers,
        heads=args.heads,
        implementation=implementation,
        key=jax.random.key(0),
    )
    clock = StepClock()
    trainer = px.DataParallelTrainer(
        model,
        optax.adamw(args.lr),
        strategy=px.ShardingStrategy(devices=1),
        loss=next_byte_loss,
        metrics=(),
        callbacks=[clock],
        precision=args.precision,
        progress=False,
    )
    trainer.fit(windows(seq), steps=args.steps)
    between = np.diff(clock.ends)
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "seq": seq,
        "implementation": implementation,
        "parameters": sum(
            x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))
        ),
        "steps": args.steps,
        # The median step after the first (which compiles); None with one step.
        "ms_per_step": float(np.median(between)) * 1e3 if len(between) else None,
        "first_step_s": clock.ends[0] - clock.start,
        "tokens_per_s": seq / float(np.median(between)) if len(between) else None,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "bytes_limit": stats.get("bytes_limit"),
        "losses": clock.losses,
        "loss": clock.losses[-1],
    }


def show(run: dict) -> str:
    ms, peak = run["ms_per_step"], run["peak_bytes_in_use"]
    return (
        f"seq {run['seq']:>6} ({run['implementation']}): {run['parameters']:,} "
        f"parameters, {'n/a' if ms is None else f'{ms:.1f}'} ms a step (median "
        f"after the first, which took {run['first_step_s']:.1f} s), peak "
        f"{'n/a' if peak is None else f'{peak / 2**30:.2f} GiB'}, loss "
        f"{run['losses'][0]:.4f} -> {run['loss']:.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", default="16384,32768,65536", help="tokens, a list")
    parser.add_argument("--steps", type=int, default=5, help="updates at each seq")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="auto: bf16 on a TPU, else fp32",
    )
    parser.add_argument(
        "--highest",
        action="store_true",
        help="float32 matmuls exact (jax.default_matmul_precision('highest'))",
    )
    parser.add_argument(
        "--compare-xla", type=int, metavar="SEQ", help="kernel against XLA at SEQ"
    )
    parser.add_argument("--out", help="write the numbers as JSON")
    args = parser.parse_args()
    if args.precision == "auto":
        args.precision = "bf16" if jax.default_backend() == "tpu" else "fp32"
    if args.highest:
        jax.config.update("jax_default_matmul_precision", "highest")
    said: list[str] = []  # phalanx's warnings: a kernel's refusal names itself

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("phalanx").addHandler(Said(logging.WARNING))
    device = jax.devices()[0]
    print(
        f"{device.device_kind} ({jax.device_count()} device(s)), precision "
        f"{args.precision}{', highest matmuls' if args.highest else ''}; "
        f"{args.layers} blocks of width {args.width}, {args.heads} heads, remat"
    )
    record: dict = {
        "device": device.device_kind,
        "jax": jax.__version__,
        "precision": args.precision,
        "highest": args.highest,
        "model": {"layers": args.layers, "width": args.width, "heads": args.heads},
    }
    if args.compare_xla:
        runs = [train(args, args.compare_xla, name) for name in ("auto", "xla")]
        for run in runs:
            print(show(run))
        difference = abs(runs[0]["loss"] - runs[1]["loss"])
        print(
            f"after {args.steps} steps at {args.compare_xla} tokens: loss "
            f"{runs[0]['loss']:.6f} with implementation='auto' (on a TPU the "
            f"kernel), {runs[1]['loss']:.6f} with 'xla': |difference| "
            f"{difference:.2e}"
        )
        record["compare_xla"] = {
            "seq": args.compare_xla,
            "steps": args.steps,
            "loss_auto": runs[0]["loss"],
            "loss_xla": runs[1]["loss"],
            "abs_difference": difference,
            "runs": runs,
        }
    else:
        print("peak: the process' high-water mark, sequences in increasing order")
        record["runs"] = []
        for seq in sorted(map(int, args.seq.split(","))):
            try:
                run = train(args, seq, "auto")
            except Exception as error:  # out of memory: said, and the next seq
                if not out_of_memory(error):
                    raise
                run = {"seq": seq, "implementation": "auto", "error": "out of memory"}
                print(f"seq {seq:>6}: out of memory ({str(error).splitlines()[0]})")
            else:
                print(show(run))
            record["runs"].append(run)
            write(args.out, record | {"warnings": said})
    for message in said:
        print("warning:", message)
    write(args.out, record | {"warnings": said})


def out_of_memory(error: Exception) -> bool:
    """Whether `error` is XLA's out of memory (at compile time or run time)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def write(path: str | None, record: dict) -> None:
    """The numbers so far as JSON at `path` (nothing where None)."""
    if path:
        pathlib.Path(path).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
