"""The planner's predictions against what the device measures (issue 57,
acceptance 1): for each configuration of a grid over three models, the
plan's predicted peak and step time (a plan of that one candidate, the
cost model calibrated on the device: `px.calibrate`, cached) beside the
device memory the steps held (`footprint`) and the step time measured
training it; then
the plan of the largest model over its whole grid, its time and compiles,
and whether its choice is within 5% of the best measured.

The models: the wide MLP of `benchmarks/tpu.py`'s cells (1024-4096×3-10,
batch 4096), the tests' `Stacked` transformer (19.2 M, 512 tokens, batch
32) and `examples/language_model.py`'s decoder at GPT-2 small (124 M, 1,024
tokens, batch 8); each in fp32 or bf16, `Stacked` remat off or on, 1, 2 or
4 microbatches, on one device (`ShardingStrategy`, planned as it is).

Each configuration runs in a process of its own: `peak_bytes_in_use` is a
process's high-water mark, so one process a configuration is the only way
each peak is its own. A child writes one JSON line: the plan's row (its
compiled memory as `memory_analysis` says it, the peak and step it
predicts; on the v5e the trainer's own step compiled to the same figures
in every configuration), the device's memory statistics before and after
the steps and the footprint they give, and the measured step: the median
of three slopes of a fit's time over its steps (a fit of ``1 + --steps``
batches less a fit of one, over ``--steps``), so that what a fit call
costs once cancels.

Off an accelerator (no memory statistics) the peaks are "n/a" and the
grid is tiny (``--tiny``): the harness's smoke test.

Run: ``python benchmarks/plan_accuracy.py [--models mlp,transformer,decoder]
[--tiny] [--steps 6] [--out DIR]`` (``bash benchmarks/tpu.sh plan`` and
``plan125`` on the lent TPU).
"""

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any


ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]

# (model, precision, remat, microbatches): 13 on the chip.
GRID = {
    "mlp": [("fp32", None, 1), ("bf16", None, 1), ("fp32", None, 2)],
    "transformer": [
        ("fp32", False, 1),
        ("fp32", True, 1),
        ("fp32", False, 2),
        ("bf16", False, 1),
        ("bf16", True, 4),
    ],
    "decoder": [
        ("bf16", False, 1),
        ("bf16", True, 1),
        ("bf16", True, 2),
        ("bf16", True, 4),
        ("fp32", True, 1),
    ],
}
# Each model's batch, at full size and tiny (--tiny, off an accelerator).
BATCHES = {"mlp": (4096, 64), "transformer": (32, 8), "decoder": (8, 4)}
# A child's limit: its imports, two compiles and the timed fits.
CHILD_SECONDS = 240


def build(name: str, tiny: bool) -> tuple[Any, Any, Any]:
    """Model `name`'s factory, its loss and one batch (numpy) of it."""
    import equinox as eqx
    import jax
    import numpy as np
    import optax

    rng = np.random.default_rng(0)
    batch = BATCHES[name][int(tiny)]
    if name == "mlp":
        width, depth = (64, 2) if tiny else (4096, 3)
        features = 32 if tiny else 1024

        def make() -> Any:
            return eqx.nn.MLP(features, 10, width, depth, key=jax.random.key(0))

        def loss(logits: Any, labels: Any) -> Any:
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

        x = rng.standard_normal((batch, features)).astype(np.float32)
        return make, loss, (x, rng.integers(0, 10, batch).astype(np.int32))
    if name == "transformer":
        from stacked_transformer import Transformer

        width, layers, heads, seq = (32, 2, 2, 16) if tiny else (512, 6, 8, 512)

        def make() -> Any:
            return Transformer(
                vocab=256, width=width, layers=layers, heads=heads,
                key=jax.random.key(0),
            )  # fmt: skip
    else:
        import language_model as example

        size = dict(example.SIZES["tiny" if tiny else "gpt2"])
        seq = 32 if tiny else size["seq"]

        def make() -> Any:
            return example.Decoder(**size, key=jax.random.key(0))

    def tokens_loss(logits: Any, targets: Any) -> Any:
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return per_token.mean(-1)

    tokens = rng.integers(0, 256, (batch, seq + 1)).astype(np.int32)
    return make, tokens_loss, (tokens[:, :-1], tokens[:, 1:])


def planned(name: str, tiny: bool) -> tuple[Any, Any, Any, Any, int]:
    """Model `name`'s factory, loss and batch (`build`), the batch's shapes,
    and the budget a plan of it gets: the first device's memory (where JAX
    reports it; else 1 TiB, on a CPU)."""
    import jax

    make, loss, batch = build(name, tiny)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    stats = jax.devices()[0].memory_stats() or {}
    return make, loss, batch, shapes, stats.get("bytes_limit", 2**40)


def one(config: dict[str, Any]) -> dict[str, Any]:
    """One configuration planned, then trained: the child's record."""
    import jax
    import optax

    import phalanx as px

    make, loss, batch, shapes, budget = planned(config["model"], config["tiny"])
    device = jax.devices()[0]
    remat = config["remat"]
    space = px.PlanSpace(
        remat=None if remat is None else (remat,),
        microbatches=(config["microbatches"],),
    )
    kwargs = {"loss": loss, "precision": config["precision"], "metrics": ()}
    began = time.perf_counter()
    plan = px.plan(
        make, optax.adamw(3e-4), shapes, budget=budget, margin=0.0, space=space,
        strategy=px.ShardingStrategy(jax.devices()[:1]), progress=False, **kwargs,
    )  # fmt: skip
    record: dict[str, Any] = {"plan_seconds": time.perf_counter() - began}
    record["after_plan"] = device.memory_stats()
    [row] = plan.rows
    record |= {"status": row.status, "why": row.why}
    if row.measured is not None:
        m = row.measured
        record["predicted"] = {
            "peak": m.peak,
            "memory": dataclasses.asdict(m.memory),
            "seconds": m.seconds,
            "compute": m.compute,
            "traffic": m.traffic,
            "kernels": m.kernels,
            "communication": m.communication,
            "flops": m.flops,
            "accessed": m.accessed,
        }
    record["device_spec"] = str(plan.device)
    if plan.choice is None:
        return record
    trainer = px.DataParallelTrainer(
        plan.model(make()), optax.adamw(3e-4), progress=False,
        **plan.trainer_kwargs(), **kwargs,
    )  # fmt: skip
    placed = jax.device_put(batch, trainer.strategy.batch_sharding)
    # Before any step: what the state and batch hold, and the high-water
    # mark of building them (the trainer's placement copies included).
    record["before_steps"] = device.memory_stats()
    trainer.fit([placed] * 2)  # warm up (its step is the plan's executable)
    record["after_first_fit"] = device.memory_stats()
    slopes = []
    for _ in range(3):
        start = time.perf_counter()
        trainer.fit([placed])
        once = time.perf_counter() - start
        start = time.perf_counter()
        trainer.fit([placed] * (1 + config["steps"]))
        many = time.perf_counter() - start
        slopes.append((many - once) / config["steps"])
    jax.block_until_ready(trainer.state)
    record["measured_seconds"] = statistics.median(slopes)
    record["memory_stats"] = device.memory_stats()
    record["device_peak"] = footprint(record["before_steps"], record["memory_stats"])
    live = sorted(jax.live_arrays(), key=lambda a: -a.nbytes)
    record["live"] = {
        "bytes": sum(a.nbytes for a in live),
        "count": len(live),
        "largest": [f"{a.dtype}{list(a.shape)}" for a in live[:6]],
    }
    return record


def footprint(
    before: dict[str, int] | None, after: dict[str, int] | None
) -> int | None:
    """The device memory the training steps held at most: the buffers in
    use (the state, the batch) at their fullest during the steps, plus the
    region a TPU reserves for its executables' temporaries.

    On the TPU, ``peak_bytes_in_use`` leaves a step's temporaries out: they
    live in ``bytes_reserved`` (measured on a v5e: ``peak_bytes_reserved``
    1-5% under the step's `temp_size_in_bytes` for the tests' transformer,
    up to 21% under for the MLP, and no allocation as large as it). And
    its high-water mark is the process's: what ran before the steps (the
    plan, building the trainer) may have set it. So: the in-use bytes when
    the steps began, or the high-water mark where the steps raised it, plus
    the reserved region's peak. None off an accelerator (no memory
    statistics)."""
    if not before or not after or "peak_bytes_in_use" not in after:
        return None
    raised = after["peak_bytes_in_use"] > before["peak_bytes_in_use"]
    in_use = after["peak_bytes_in_use"] if raised else before["bytes_in_use"]
    return in_use + after.get("peak_bytes_reserved", 0)


def child(arguments: list[str], env: dict[str, str]) -> dict[str, Any]:
    """This script with `arguments` (``--one CONFIG``: `one`, its peak its
    own; ``--whole MODEL``: `whole_plan`) in a process of its own: the JSON
    line it prints last, or the error that stopped it."""
    command = [sys.executable, __file__, *arguments]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=CHILD_SECONDS, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": f"over {CHILD_SECONDS} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return json.loads(lines[-1])


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The errors over the configurations that ran: peak (predicted ÷ the
    device's, less 1) and step time (predicted ÷ measured, less 1)."""
    peaks, times = [], []
    for row in rows:
        predicted = row.get("predicted") or {}
        device = row.get("device_peak")
        if device and predicted.get("peak"):
            peaks.append(predicted["peak"] / device - 1)
        if row.get("measured_seconds") and predicted.get("seconds"):
            times.append(predicted["seconds"] / row["measured_seconds"] - 1)
    out: dict[str, Any] = {"configurations": len(rows)}
    if peaks:
        out["peak_error"] = {
            "worst": max(peaks, key=abs),
            "under_by_most": min(peaks),
            "within_5_percent": sum(abs(e) <= 0.05 for e in peaks),
        }
    if times:
        absolute = [abs(e) for e in times]
        out["time_error"] = {
            "median": statistics.median(absolute),
            "worst": max(absolute),
        }
    return out


def whole_plan(name: str, tiny: bool) -> dict[str, Any]:
    """The plan of model `name` over its grid's remat and microbatches, in
    its precision of the grid's first: its time, compiles and choice."""
    import jax
    import optax

    import phalanx as px

    make, loss, _, shapes, budget = planned(name, tiny)
    precision = GRID[name][0][0]
    remats = sorted({r for p, r, _ in GRID[name] if p == precision and r is not None})
    space = px.PlanSpace(
        remat=tuple(remats) or None,
        microbatches=tuple(sorted({k for p, _, k in GRID[name] if p == precision})),
    )
    began = time.perf_counter()
    plan = px.plan(
        make, optax.adamw(3e-4), shapes, budget=budget, space=space,
        strategy=px.ShardingStrategy(jax.devices()[:1]),
        progress=False, loss=loss, precision=precision, metrics=(),
    )  # fmt: skip
    seconds = time.perf_counter() - began
    print(plan, file=sys.stderr)
    chosen = plan.choice
    return {
        "seconds": seconds,
        "compiled": plan.compiled,
        "from_cache": plan.from_cache,
        "reused": plan.reused,
        "precision": precision,
        "chosen": None
        if chosen is None
        else {
            "remat": chosen.candidate.remat,
            "microbatches": chosen.candidate.microbatches,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--whole", help=argparse.SUPPRESS)
    parser.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--models", default="mlp,transformer,decoder")
    parser.add_argument(
        "--whole-of",
        help="the model whose whole grid is planned (default: the last of "
        "--models; none: no whole plan)",
    )
    parser.add_argument(
        "--measured",
        action="append",
        default=[],
        help="an earlier run's JSON whose measured rows the whole plan's "
        "choice is compared with too (a device call each part)",
    )
    parser.add_argument(
        "--configs",
        help="the configurations run, instead of the models' grids: "
        "MODEL:PRECISION:REMAT:MICROBATCHES,... (REMAT on, off or -), e.g. "
        "mlp:bf16:-:1,decoder:bf16:on:2",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny models (CPU)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps a slope")
    parser.add_argument("--out", default="/tmp/phalanx-tpu")
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(json.loads(args.one)), default=str))
        return
    if args.whole is not None:
        print(json.dumps(whole_plan(args.whole, args.tiny), default=str))
        return
    if args.calibrate:
        import phalanx as px

        print(json.dumps({"device": str(px.calibrate())}))
        return
    env = dict(os.environ)
    # A child's fit takes its plan's executable; the whole plan reads the
    # configurations' programs from JAX's persistent cache (`from_cache`).
    env.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/phalanx-plan-accuracy-cache")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    models = [name for name in args.models.split(",") if name]
    configs = _configs(args.configs, models)
    if args.configs:
        models = list(dict.fromkeys(config[0] for config in configs))
    last = args.whole_of or (models[-1] if models else "none")
    rows = []
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    named = "_".join(models) or f"whole_{last}"
    path = out / f"plan_accuracy_{named}.json"
    # Calibrated (and cached) in a process of its own first: its matmuls'
    # buffers would otherwise set the first configuration's high-water mark.
    result: dict[str, Any] = {"calibration": child(["--calibrate"], env)}
    for name, precision, remat, microbatches in configs:
        config = {
            "model": name, "precision": precision, "remat": remat,
            "microbatches": microbatches, "tiny": args.tiny, "steps": args.steps,
        }  # fmt: skip
        began = time.perf_counter()
        record = config | child(["--one", json.dumps(config)], env)
        record["wall_seconds"] = time.perf_counter() - began
        rows.append(record)
        print(json.dumps(_brief(record)), flush=True)
        result |= {"rows": rows, "summary": summary(rows)}
        path.write_text(json.dumps(result, indent=1, default=str))
    result.setdefault("summary", summary(rows))
    if last == "none":
        path.write_text(json.dumps(result, indent=1, default=str))
        return
    whole = ["--whole", last, *(["--tiny"] if args.tiny else [])]
    result["whole_plan"] = child(whole, env) | {"model": last}
    earlier = [
        row
        for file in args.measured
        for row in json.loads(pathlib.Path(file).read_text()).get("rows", [])
    ]
    measured = [
        (r["measured_seconds"], r["remat"], r["microbatches"])
        for r in rows + earlier
        if r["model"] == last
        and r.get("measured_seconds")
        and r["precision"] == result["whole_plan"].get("precision")
    ]
    chosen = result["whole_plan"].get("chosen")
    if measured and chosen:
        best = min(measured)[0]
        picked = [
            s
            for s, r, k in measured
            if (r, k) == (chosen["remat"], chosen["microbatches"])
        ]
        if picked:
            result["whole_plan"]["chosen_over_best"] = picked[0] / best
    print(
        json.dumps({"summary": result["summary"], "whole_plan": result["whole_plan"]})
    )
    path.write_text(json.dumps(result, indent=1, default=str))


def _configs(given: str | None, models: list[str]) -> list[tuple[Any, ...]]:
    """The configurations run: `given` (``--configs``), else the grids of
    `models`."""
    if given is None:
        return [(name, *config) for name in models for config in GRID[name]]
    remats = {"on": True, "off": False, "-": None}
    configs = []
    for item in given.split(","):
        name, precision, remat, microbatches = item.split(":")
        configs.append((name, precision, remats[remat], int(microbatches)))
    return configs


def _brief(record: dict[str, Any]) -> dict[str, Any]:
    """A configuration's line: what it was, predicted and measured."""
    predicted = record.get("predicted") or {}
    device = record.get("device_peak")
    return {
        key: record.get(key)
        for key in ("model", "precision", "remat", "microbatches", "status", "error")
    } | {
        "peak": predicted.get("peak"),
        "device_peak": device,
        "step": predicted.get("seconds"),
        "measured": record.get("measured_seconds"),
    }


if __name__ == "__main__":
    main()
