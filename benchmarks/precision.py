"""Mixed precision against float32: step time and the compiled step's memory.

Usage::

    python benchmarks/precision.py [--devices 1,8] [--batch 2048] [--steps 20]
        [--repeats 5] [--out benchmarks/precision.json] [--tiny]

On each device count, the benchmark's MLP 784-256-128-10 with adam at
``--batch`` (host NumPy batches) under ``precision="fp32"``, ``"bf16"`` and
``"fp16"``: the compiled train step's temporary and argument bytes per device
(`memory_analysis()`), and the median seconds per step of ``--repeats`` runs
of ``--steps`` steps, interleaved (fp32 bf16 fp16 fp32 ...), with each
policy's time relative to fp32 (above 1: slower).

These CPUs have no bfloat16 or float16 arithmetic units: XLA:CPU computes
each half-precision dot product in float32 and rounds its result, so the
casts cost time here and nothing is gained; on accelerators with bf16 matrix
units the same program runs its dot products at their speed. ``--tiny``
(the CI smoke test): 1 and 2 devices, batch 64, 2 steps, 1 repeat.
"""

import argparse
import json
import sys
from typing import Any

from children import interleaved, parse as parse_options, per_device_count, write_json


POLICIES = ("fp32", "bf16", "fp16")
TINY = {"devices": "1,2", "batch": 64, "steps": 2, "repeats": 1}
DEFAULTS = {"devices": "1,8", "batch": 2048, "steps": 20, "repeats": 5}


def parse(argv: list[str] | None) -> argparse.Namespace:
    return parse_options(
        argv, __doc__, out="benchmarks/precision.json", tiny=TINY, defaults=DEFAULTS
    )


def child(args: argparse.Namespace) -> None:
    """One device count's figures, as JSON on stdout."""
    import phalanx as px

    px.fake_cpu_devices(args.child)
    import jax
    import numpy as np
    import optax

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, args.batch).astype(np.int32)
    trainers = {
        policy: px.DataParallelTrainer(
            px.models.MLP(784, 10, hidden=(256, 128), key=jax.random.key(0)),
            optax.adam(1e-3),
            precision=policy,
            progress=False,
        )
        for policy in POLICIES
    }
    rows = []
    for policy, trainer in trainers.items():
        stats = trainer.lower((x, y)).compile().memory_analysis()
        rows.append(
            {
                "precision": policy,
                "devices": args.child,
                "temp_bytes": stats.temp_size_in_bytes,
                "argument_bytes": stats.argument_size_in_bytes,
            }
        )
    timed = interleaved(trainers, [(x, y)] * args.steps, args.repeats)
    for row in rows:
        row["step_s"] = timed["median_s"][row["precision"]]
        row["vs_fp32"] = row["step_s"] / timed["median_s"]["fp32"]
        row["seconds"] = timed["seconds"][row["precision"]]
    print(json.dumps(rows))


def report(rows: list[dict[str, Any]], batch: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"MLP 784-256-128-10, adam, batch {batch}, per device")
    for column in (
        "devices",
        "precision",
        "ms/step",
        "vs fp32",
        "temp MiB",
        "args MiB",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["devices"]),
            row["precision"],
            f"{row['step_s'] * 1e3:.2f}",
            f"{row['vs_fp32']:.3f}",
            f"{row['temp_bytes'] / 2**20:.2f}",
            f"{row['argument_bytes'] / 2**20:.2f}",
        )
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child is not None:
        child(args)
        return 0
    counts = [int(n) for n in args.devices.split(",")]
    rows = [row for rows in per_device_count(__file__, argv, counts) for row in rows]
    report(rows, args.batch)
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
