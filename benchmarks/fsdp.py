"""`FullyShardedStrategy` against `ShardingStrategy`: memory per device, and
step time.

Usage::

    python benchmarks/fsdp.py [--devices 1,2,4,8] [--width 4096] [--layers 3]
        [--time-devices 8] [--batch 2048] [--steps 20] [--repeats 5]
        [--out benchmarks/fsdp.json] [--tiny]

Memory (compile only: each trainer is built, its train step lowered and
compiled, nothing trained), for an MLP ``width -> width x layers -> 10``
(4096 and 3: 50.4 M parameters) with adam, on each device count: the bytes
of the parameters and optimizer state on the fullest device (read from the
arrays' addressable shards), and the compiled step's argument and temporary
bytes per device (`memory_analysis()`), for `ShardingStrategy`,
`FullyShardedStrategy()` (``shard="all"``) and
``FullyShardedStrategy(shard="optimizer")``.

Time: on ``--time-devices`` devices, the benchmark's MLP 784-256-128-10 at
``--batch`` (host NumPy batches), each side's ``--steps`` steps timed
``--repeats`` times, interleaved (A B A B ...); the median seconds per step
of each and their ratio, FSDP / Sharding (above 1: FSDP slower).

Each device count runs in a process of its own (JAX fixes the fake CPU
device count when it starts; `px.fake_cpu_devices` also sets ``NPROC``).
``--tiny`` (the CI smoke test): a 64-wide model on 1 and 2 devices, 2 steps
of batch 64, 1 repeat.
"""

import argparse
import json
import sys
from typing import Any

from children import interleaved, parse as parse_options, per_device_count, write_json


SIDES = ("sharding", "fsdp", "fsdp-optimizer")
TINY = {
    "devices": "1,2",
    "width": 64,
    "layers": 2,
    "time_devices": 2,
    "batch": 64,
    "steps": 2,
    "repeats": 1,
}
DEFAULTS = {
    "devices": "1,2,4,8",
    "width": 4096,
    "layers": 3,
    "time_devices": 8,
    "batch": 2048,
    "steps": 20,
    "repeats": 5,
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    return parse_options(
        argv,
        __doc__,
        out="benchmarks/fsdp.json",
        tiny=TINY,
        defaults=DEFAULTS,
        extra=(
            ("--width", int, "hidden width of the memory model"),
            ("--layers", int, "hidden layers of the memory model"),
            ("--time-devices", int, "device count of the timing"),
        ),
    )


def make_strategy(side: str) -> Any:
    import phalanx as px

    if side == "sharding":
        return px.ShardingStrategy()
    return px.FullyShardedStrategy(
        shard="optimizer" if side == "fsdp-optimizer" else "all"
    )


def memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each side's bytes per device for the memory model (compile only)."""
    import equinox as eqx
    import jax
    import numpy as np
    import optax

    import phalanx as px

    rows = []
    batch = (np.zeros((64, args.width), np.float32), np.zeros(64, np.int32))
    for side in SIDES:
        model = px.models.MLP(
            args.width, 10, hidden=(args.width,) * args.layers, key=jax.random.key(0)
        )
        trainer = px.DataParallelTrainer(
            model, optax.adam(1e-3), strategy=make_strategy(side), progress=False
        )
        state = eqx.filter((trainer.state.model, trainer.state.opt_state), eqx.is_array)
        held: dict[Any, int] = {}
        for leaf in jax.tree.leaves(state):
            for shard in leaf.addressable_shards:
                held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
        params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
        stats = trainer.lower(batch).compile().memory_analysis()
        rows.append(
            {
                "side": side,
                "devices": jax.device_count(),
                "parameters": params,
                "state_bytes": sum(x.nbytes for x in jax.tree.leaves(state)),
                "state_bytes_per_device": max(held.values()),
                "argument_bytes": stats.argument_size_in_bytes,
                "temp_bytes": stats.temp_size_in_bytes,
            }
        )
        del trainer, model, state
    return rows


def timing(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per step of Sharding (B) and FSDP (A) on the benchmark MLP."""
    import jax
    import numpy as np
    import optax

    import phalanx as px

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, args.batch).astype(np.int32)
    trainers = {
        side: px.DataParallelTrainer(
            px.models.MLP(784, 10, hidden=(256, 128), key=jax.random.key(0)),
            optax.adam(1e-3),
            strategy=make_strategy(side),
            progress=False,
        )
        for side in ("fsdp", "sharding")
    }
    timed = interleaved(trainers, [(x, y)] * args.steps, args.repeats)
    a, b = (timed["median_s"][side] for side in ("fsdp", "sharding"))
    return {"seconds": timed["seconds"], "fsdp_s": a, "sharding_s": b, "ratio": a / b}


def child(args: argparse.Namespace) -> None:
    """One device count's figures, as JSON on stdout."""
    import phalanx as px

    px.fake_cpu_devices(args.child)
    result: dict[str, Any] = {"memory": memory(args)}
    if args.child == args.time_devices:
        result["timing"] = timing(args)
    print(json.dumps(result))


def report(rows: list[dict[str, Any]], timed: dict[str, Any] | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="parameters + adam state, and the compiled step, per device")
    for column in (
        "devices",
        "strategy",
        "state MiB",
        "of total",
        "args MiB",
        "temp MiB",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["devices"]),
            row["side"],
            f"{row['state_bytes_per_device'] / 2**20:.1f}",
            f"{row['state_bytes_per_device'] / row['state_bytes']:.3f}",
            f"{row['argument_bytes'] / 2**20:.1f}",
            f"{row['temp_bytes'] / 2**20:.1f}",
        )
    console = Console()
    console.print(table)
    console.print(f"memory model: {rows[0]['parameters'] / 1e6:.1f} M parameters")
    if timed is not None:
        console.print(
            f"step time on {timed['devices']} devices, batch {timed['batch']}: "
            f"FSDP {timed['fsdp_s'] * 1e3:.2f} ms, Sharding "
            f"{timed['sharding_s'] * 1e3:.2f} ms, FSDP / Sharding {timed['ratio']:.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child is not None:
        child(args)
        return 0
    counts = [int(n) for n in args.devices.split(",")]
    rows: list[dict[str, Any]] = []
    timed = None
    for n, result in zip(counts, per_device_count(__file__, argv, counts), strict=True):
        rows += result["memory"]
        if "timing" in result:
            timed = {**result["timing"], "devices": n, "batch": args.batch}
    report(rows, timed)
    write_json(args.out, {"memory": rows, "timing": timed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
