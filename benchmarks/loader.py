"""Does the loader keep up? The share of a fit's time spent waiting for data,
for a decode-heavy pipeline (about 1 ms of NumPy work per example), read by
a plain Python loader (the baseline), by `px.data.GrainLoader` in threads,
and by `GrainLoader` with grain worker processes.

The model steps on one CPU device whose XLA runs on one thread: the
accelerator's stand-in, leaving the machine's other cores to the data (on a
GPU host the step does not use the host's cores at all). Each row is one
fit of ``--steps`` steps after a warm-up; the share is `Timeline`'s
``time/data`` over ``time/data + time/step``: the time the loop waited for
a batch against the time it spent dispatching and waiting for steps.

Run: ``python benchmarks/loader.py [--steps 60] [--batch 32] [--workers 2]
[--out F]``
"""

import os
import sys


# Before JAX starts: one device, one XLA thread (see the module docstring).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import phalanx as px  # noqa: E402


EXAMPLES = 8192
SIDE = 32
_MIX = np.random.default_rng(1).standard_normal((SIDE, SIDE)).astype(np.float32) / SIDE


class Images:
    """Random access to `EXAMPLES` uint8 images 32 × 32 × 3 and labels."""

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int32]:
        rng = np.random.default_rng(index)
        return rng.integers(0, 256, (SIDE, SIDE, 3), np.uint8), np.int32(index % 10)


class Decode:
    """The per-example work: normalise, then `rounds` mixing passes (about
    1 ms in all, set by `calibrate`), flattened to features."""

    def __init__(self, rounds: int):
        self.rounds = rounds

    def __call__(self, example: tuple[np.ndarray, np.int32]):
        image, label = example
        x = image.astype(np.float32) / 255.0
        for _ in range(self.rounds):
            x = np.tanh(np.einsum("ij,jkc->ikc", _MIX, x))
        return x.reshape(-1), label


def calibrate(target: float = 1e-3) -> Decode:
    """A `Decode` taking about `target` seconds an example here."""
    example = Images()[0]
    one = Decode(1)
    start = time.perf_counter()
    for _ in range(50):
        one(example)
    per_round = (time.perf_counter() - start) / 50
    return Decode(max(1, round(target / per_round)))


class PlainLoader:
    """The baseline: a Python loop over a shuffled epoch, decoding each
    example in the trainer's process, stacking batches."""

    def __init__(self, decode: Decode, batch: int):
        self.decode, self.batch, self.epoch = decode, batch, 0

    def __iter__(self):
        order = np.random.default_rng([0, self.epoch]).permutation(EXAMPLES)
        self.epoch += 1
        source = Images()
        for start in range(0, EXAMPLES - self.batch + 1, self.batch):
            rows = [self.decode(source[i]) for i in order[start : start + self.batch]]
            yield np.stack([r[0] for r in rows]), np.array([r[1] for r in rows])


def share(data, steps: int, hidden: int) -> dict[str, float]:
    """One fit's data wait share, after a warm-up fit (compile, workers)."""
    model = px.models.MLP(
        SIDE * SIDE * 3, 10, hidden=(hidden, hidden), key=jax.random.key(0)
    )
    trainer = px.DataParallelTrainer(
        model,
        optax.adam(1e-3),
        strategy=px.ShardingStrategy(jax.devices()[:1]),
        callbacks=[px.callbacks.Timeline()],
        progress=False,
    )
    trainer.fit(data, steps=5)
    trainer.fit(data, steps=5 + steps)
    row = trainer.history[-1]
    waited, stepped = row["time/data"], row["time/step"]
    return {
        "data_s": waited,
        "step_s": stepped,
        "share": waited / (waited + stepped),
        "examples_per_s": steps * data_batch(data) / (waited + stepped),
    }


def data_batch(data) -> int:
    return data.batch_size if isinstance(data, px.data.GrainLoader) else data.batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--hidden", type=int, default=4096, help="the MLP's widths: the step's cost"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    decode = calibrate()
    example = Images()[0]
    start = time.perf_counter()
    for _ in range(50):
        decode(example)
    per_example = (time.perf_counter() - start) / 50
    print(f"decode: {per_example * 1e3:.2f} ms an example; {os.cpu_count()} cores")
    import grain

    examples = grain.MapDataset.source(Images()).map(decode)
    sides = {
        "plain Python loader": PlainLoader(decode, args.batch),
        "GrainLoader, threads": px.data.GrainLoader(
            examples, args.batch, read_threads=2
        ),
        f"GrainLoader, {args.workers} workers": px.data.GrainLoader(
            examples, args.batch, worker_count=args.workers, read_threads=1
        ),
    }
    rows = {
        "decode_ms": per_example * 1e3,
        "batch": args.batch,
        "hidden": args.hidden,
        "sides": {},
    }
    for name, data in sides.items():
        measured = share(data, args.steps, args.hidden)
        if isinstance(data, px.data.GrainLoader):
            data.close()
        rows["sides"][name] = measured
        print(
            f"{name:<28} data wait {measured['share']:6.1%} of the loop "
            f"({measured['data_s']:.2f} s data, {measured['step_s']:.2f} s steps), "
            f"{measured['examples_per_s']:.0f} examples/s, "
            f"{measured['step_s'] / args.steps * 1e3:.0f} ms a step"
        )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
