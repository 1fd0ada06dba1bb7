"""`MeshStrategy` and `Stacked` layers: memory per device, per-layer
gathering, remat, and compile time against depth.

Usage::

    python benchmarks/mesh.py [--width 1024] [--layers 8] [--batch 64]
        [--depths 4,16,64] [--out benchmarks/mesh.json] [--tiny]

On 8 fake CPU devices (compile only unless said: each trainer is built and
its train step lowered and compiled):

- **layouts**: a residual stack of ``--layers`` blocks of ``--width``
  (``x + relu(W x + b)``: 1 M parameters a block at 1024) with adam, under
  `ShardingStrategy`, `FullyShardedStrategy`, and `MeshStrategy` with
  ``fsdp=8`` (stacked and unrolled), ``data=2, fsdp=4`` and ``fsdp=4,
  tensor=2`` with rules: the parameters and optimizer state on the fullest
  device, the model's full parameter bytes, and the compiled step's
  temporary and peak bytes per device (`memory_analysis()`), with the
  median step time of a few steps;
- **remat**: a deep, narrow stack (a quarter of ``--width``) at a batch 64
  times ``--batch`` (activations dominate) under ``data=8``, with and
  without ``remat=True``: temporary bytes;
- **compile**: the train step's compile time for ``--depths`` layers of
  width 64, stacked and unrolled.
"""

import argparse
import json
import pathlib
import statistics
import time
from typing import Any


# --tiny compiles every case but times no step (a smoke test of the harness).
TINY = {"width": 64, "layers": 2, "batch": 16, "depths": "2,4", "steps": 0}
DEFAULTS = {"width": 1024, "layers": 8, "batch": 64, "depths": "4,16,64", "steps": 5}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--depths", help="layer counts of the compile timing")
    parser.add_argument("--steps", type=int, help="timed steps per layout")
    parser.add_argument("--out", default="benchmarks/mesh.json")
    parser.add_argument("--tiny", action="store_true", help="a smoke-test run")
    args = parser.parse_args(argv)
    for name, default in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def make_net(width: int, layers: int, *, stacked: bool, remat: bool = False) -> Any:
    import equinox as eqx
    import jax

    import phalanx as px

    class Block(eqx.Module):
        linear: eqx.nn.Linear

        def __init__(self, key):
            self.linear = eqx.nn.Linear(width, width, key=key)

        def __call__(self, x):
            return x + jax.nn.relu(self.linear(x))

    class Net(eqx.Module):
        blocks: Any
        head: eqx.nn.Linear

        def __init__(self, key):
            one, two = jax.random.split(key)
            if stacked:
                self.blocks = px.models.Stacked(Block, layers, key=one, remat=remat)
            else:
                self.blocks = tuple(Block(k) for k in jax.random.split(one, layers))
            self.head = eqx.nn.Linear(width, 10, key=two)

        def __call__(self, x):
            if stacked:
                return self.head(self.blocks(x))
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Net(jax.random.key(0))


def measure(model: Any, strategy: Any, batch: Any, steps: int) -> dict[str, Any]:
    """Bytes per device, compile seconds and (with `steps`) step seconds."""
    import equinox as eqx
    import jax
    import optax

    import phalanx as px

    trainer = px.DataParallelTrainer(
        model, optax.adam(1e-3), strategy=strategy, progress=False
    )
    state = eqx.filter((trainer.state.model, trainer.state.opt_state), eqx.is_array)
    held: dict[Any, int] = {}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    lowered = trainer.lower(batch)
    start = time.perf_counter()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    stats = compiled.memory_analysis()
    params = eqx.filter(model, eqx.is_array)
    row = {
        "param_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
        "state_bytes_per_device": max(held.values()),
        "temp_bytes": stats.temp_size_in_bytes,
        # What trainer.summary(batch).step.peak says: the inputs, the
        # temporaries and the outputs that reuse no input's buffer.
        "peak_bytes": stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes,
        "compile_s": compile_s,
    }
    if steps:
        trainer.fit([batch], steps=1)  # the first step compiles
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            trainer.fit([batch], steps=1)
            jax.block_until_ready(trainer.state)
            times.append(time.perf_counter() - start)
        row["step_s"] = statistics.median(times)
    return row


def layouts(args: argparse.Namespace) -> list[dict[str, Any]]:
    import numpy as np

    import phalanx as px

    rng = np.random.default_rng(0)
    batch = (
        rng.normal(size=(args.batch, args.width)).astype(np.float32),
        rng.integers(0, 10, args.batch).astype(np.int32),
    )
    rules = [(r"blocks\.layers\.linear\.weight", (None, "tensor", "fsdp"))]
    sides = {
        "ShardingStrategy": (False, lambda: px.ShardingStrategy()),
        "FullyShardedStrategy": (False, lambda: px.FullyShardedStrategy()),
        "Mesh fsdp=8, unrolled": (False, lambda: px.MeshStrategy(data=1, fsdp=8)),
        "Mesh fsdp=8, Stacked": (True, lambda: px.MeshStrategy(data=1, fsdp=8)),
        "Mesh data=2 fsdp=4, Stacked": (True, lambda: px.MeshStrategy(data=2, fsdp=4)),
        "Mesh fsdp=4 tensor=2 rules, Stacked": (
            True,
            lambda: px.MeshStrategy(data=1, fsdp=4, tensor=2, rules=rules),
        ),
    }
    rows = []
    for side, (stacked, strategy) in sides.items():
        model = make_net(args.width, args.layers, stacked=stacked)
        rows.append({"side": side, **measure(model, strategy(), batch, args.steps)})
    return rows


def remat(args: argparse.Namespace) -> list[dict[str, Any]]:
    import numpy as np

    import phalanx as px

    # Activations dominate: a narrow stack (a quarter of --width) at a batch
    # 64 times --batch.
    width, wide = args.width // 4, 64 * args.batch
    rng = np.random.default_rng(0)
    batch = (
        rng.normal(size=(wide, width)).astype(np.float32),
        rng.integers(0, 10, wide).astype(np.int32),
    )
    rows = []
    for on in (False, True):
        model = make_net(width, 2 * args.layers, stacked=True, remat=on)
        row = measure(model, px.MeshStrategy(), batch, 0)
        rows.append(
            {"remat": on, "layers": 2 * args.layers, "width": width, "batch": wide}
            | row
        )
    return rows


def compile_times(args: argparse.Namespace) -> list[dict[str, Any]]:
    import numpy as np

    import phalanx as px

    batch = (np.zeros((64, 64), np.float32), np.zeros(64, np.int32))
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        for stacked in (True, False):
            model = make_net(64, depth, stacked=stacked)
            row = measure(model, px.MeshStrategy(data=2, fsdp=4), batch, 0)
            rows.append({"layers": depth, "stacked": stacked, **row})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import phalanx as px

    px.fake_cpu_devices(8)
    results = {"layouts": layouts(args), "remat": remat(args)}
    results["compile"] = compile_times(args)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    mib = 2**20
    columns = ("params MiB", "state/dev", "temp/dev", "peak/dev")
    print(f"{'layout':38} " + " ".join(f"{c:>10}" for c in columns) + "  step ms")
    for row in results["layouts"]:
        print(
            f"{row['side']:38} {row['param_bytes'] / mib:10.1f} "
            f"{row['state_bytes_per_device'] / mib:10.1f} "
            f"{row['temp_bytes'] / mib:10.1f} {row['peak_bytes'] / mib:10.1f} "
            f"{1e3 * row.get('step_s', 0):8.1f}"
        )
    for row in results["remat"]:
        print(
            f"remat={row['remat']!s:5} {row['layers']} layers of {row['width']}, "
            f"batch {row['batch']}: "
            f"temp {row['temp_bytes'] / mib:.1f} MiB per device"
        )
    for row in results["compile"]:
        kind = "Stacked" if row["stacked"] else "unrolled"
        print(f"{row['layers']:3d} layers {kind:8}: compile {row['compile_s']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
