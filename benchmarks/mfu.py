"""Model FLOPs utilisation of a wide MLP's steps, as `Throughput` logs it.

An MLP ``--inputs``-``--hidden``×``--layers``-10, adam, on synthetic batches
already placed on the devices; `Throughput` reads the step's FLOPs
(`trainer.flops_per_step()`, counted on its program) and, on a device in its
table (NVIDIA A100/H100/H200/B200, TPU v4/v5e/v5p/v6e) or with
``--peak-flops``, logs ``mfu``. Each precision runs ``--epochs`` epochs of
``--steps`` steps; the last epoch's figures are printed (the first holds
the compile) and written to ``--out`` as JSON. On a CPU there is no ``mfu``
unless ``--peak-flops`` is given.

Usage:
    python benchmarks/mfu.py [--precision fp32,bf16] [--batch 8192]
        [--hidden 8192] [--layers 4] [--steps 50] [--epochs 3]
        [--peak-flops F] [--out mfu.json] [--tiny]

``--tiny`` (the tests): an MLP 16-32x2-10 at batch 64, 2 epochs of 4 steps,
a peak of 1e11 FLOP/s unless ``--peak-flops`` is given; it checks that the
script runs.
"""

import argparse
import json
import pathlib
import sys

import jax
import numpy as np
import optax

import phalanx as px


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="fp32,bf16")
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--inputs", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--peak-flops", type=float, default=None)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="a smoke run")
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.inputs, args.hidden, args.layers = 64, 16, 32, 2
        args.steps, args.epochs = 4, 2
        args.peak_flops = args.peak_flops or 1e11

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.inputs)).astype(np.float32)
    y = rng.integers(0, 10, size=args.batch).astype(np.int32)
    rows = []
    for precision in args.precision.split(","):
        model = px.models.MLP(
            args.inputs,
            10,
            hidden=(args.hidden,) * args.layers,
            key=jax.random.key(0),
        )
        trainer = px.DataParallelTrainer(
            model,
            optax.adam(1e-4),
            precision=precision,
            progress=False,
            callbacks=[
                px.callbacks.Throughput(log_every=10, peak_flops=args.peak_flops)
            ],
        )
        placed = jax.device_put((x, y), trainer.strategy.batch_sharding)
        trainer.fit([placed] * args.steps, epochs=args.epochs)
        history = trainer.history
        flops = trainer.flops_per_step()
        assert flops is not None
        row = {
            "precision": precision,
            "device": jax.devices()[0].device_kind,
            "devices": jax.device_count(),
            "batch": args.batch,
            "flops_per_step": flops.total,
            "steps_per_sec": history["steps_per_sec"][-1],
            "tflops_per_sec": history["tflops_per_sec"][-1],
            "mfu": history["mfu"][-1] if "mfu" in history.names else None,
        }
        rows.append(row)
        mfu = "no peak known" if row["mfu"] is None else f"mfu {row['mfu']:.3f}"
        print(
            f"{precision}: {flops.short()}, {row['steps_per_sec']:.1f} steps/s, "
            f"{row['tflops_per_sec']:.3g} TFLOP/s, {mfu} ({row['device']})"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
