"""What asynchronous checkpointing costs in training throughput.

Trains the same MLP on the same synthetic data twice over, in one process:
(A) without checkpoints and (B) with a `px.callbacks.Checkpoint` saving every
`--every` steps (orbax, asynchronous). Each timed fit runs `--steps` steps;
A and B alternate (AB, then BA, ...) for `--repeats` rounds, and the
medians are compared; so are the two fits of each round (the median of
those ratios is less moved by drift in the machine's speed), and the fastest
fits (the least disturbed by anything else running). Compilation is left
out (a warm-up fit per variant), and the warm-up's length puts every save
`--every`/2 steps away from a fit's end, so the timings are of steady
training, not of the wait at the end of a fit for its last write.

Where the time goes: each save in the timed fits records how long
a save blocks training (snapshot of the host state, copies of the
arrays queued on the devices, hand-off to the writer thread). A save is also
timed on its own, until its step folder is committed, with the CPU time it
uses: the writer runs while training goes on and, on a CPU host, competes
with XLA's compute threads for the cores. A last profile waits for the
device after every step, to show which steps after a save are slower.

Usage:
    python benchmarks/checkpoint_cost.py [--steps 400] [--repeats 10]
        [--every 100] [--out benchmarks/checkpoint_cost.json]
"""

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import resource
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
import optax
from typing_extensions import override

import phalanx as px


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="steps per timed fit")
    parser.add_argument(
        "--repeats", type=int, default=10, help="timed fits per variant"
    )
    parser.add_argument("--every", type=int, default=100, help="steps between saves")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument(
        "--hidden", default="1024,1024", help="MLP hidden widths (784-...-10)"
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path(__file__).with_name("checkpoint_cost.json"),
        help="where the JSON results go",
    )
    parser.add_argument(
        "--dir",
        type=pathlib.Path,
        default=None,
        help="where checkpoints are written (default: a temporary folder)",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "repeats", "every", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.steps < args.every:
        parser.error("--steps must be at least --every (a fit must save)")
    return args


def make_trainer(args, callbacks) -> px.DataParallelTrainer:
    hidden = tuple(int(w) for w in args.hidden.split(","))
    model = px.models.MLP(784, 10, hidden=hidden, key=jax.random.key(0))
    return px.DataParallelTrainer(
        model, optax.adam(1e-3), callbacks=callbacks, progress=False
    )


def timed_fit(trainer: px.DataParallelTrainer, loader, steps: int) -> float:
    """Seconds for `steps` steps, from the call until `fit` returns (which
    waits for the device, and for any checkpoint still being written)."""
    start = time.perf_counter()
    trainer.fit(loader, steps=steps)
    jax.block_until_ready(trainer.state)
    return time.perf_counter() - start


class SyncedClock(px.Callback):
    """Waits for the device after every step and records when it finished,
    so each step's own duration is known (a diagnostic: it stops the host
    from running ahead)."""

    def __init__(self) -> None:
        self.times: dict[int, float] = {}

    @override
    def on_step_end(self, info) -> None:
        jax.block_until_ready(info.trainer.state)
        self.times[info.step] = time.perf_counter()


def synced_profile(args, loader, directory: pathlib.Path) -> dict:
    """Each step's duration after a save, with the device waited for at every
    step: what the save itself blocks (the step right after it) and how much
    the steps that run while orbax writes in the background slow down."""
    clocks = {"none": SyncedClock(), "async_every": SyncedClock()}
    checkpoint = px.callbacks.Checkpoint(
        directory, every_n_steps=args.every, every_n_epochs=None
    )
    trainers = {
        "none": make_trainer(args, [clocks["none"]]),
        "async_every": make_trainer(args, [clocks["async_every"], checkpoint]),
    }
    warmup = args.every // 2 or 1
    for trainer in trainers.values():
        trainer.fit(loader, steps=warmup)
    for clock in clocks.values():
        clock.times.clear()
    for round_ in range(2):
        order = list(trainers) if round_ % 2 == 0 else list(trainers)[::-1]
        for name in order:
            trainers[name].fit(loader, steps=args.steps)

    def durations(clock: SyncedClock, offset: int) -> list[float]:
        t = clock.times
        return [
            t[s + offset] - t[s + offset - 1]
            for s in t
            if s % args.every == 0 and s + offset in t and s + offset - 1 in t
        ]

    span = max(1, args.every // 2 - 1)
    profile = {}
    for name, clock in clocks.items():
        # Steps far from a save: the typical step.
        steady = [
            t1 - t0
            for s, t1 in clock.times.items()
            if s % args.every >= args.every // 2
            and (t0 := clock.times.get(s - 1)) is not None
        ]
        profile[name] = {
            "steady_step_ms": 1e3 * statistics.median(steady),
            "after_save_ms": [
                1e3 * statistics.median(durations(clock, k)) for k in range(1, span + 1)
            ],
        }
    typical = profile["async_every"]["steady_step_ms"]
    extra = [ms - typical for ms in profile["async_every"]["after_save_ms"]]
    profile["extra_ms_per_save"] = sum(extra)
    profile["extra_ms_first_step"] = extra[0]
    profile["steps_slowed"] = sum(1 for e in extra if e > 0.1 * typical)
    return profile


def cpu_seconds() -> float:
    """CPU time of this process so far, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed_saves(checkpoint: px.callbacks.Checkpoint, every: int) -> list[float]:
    """Make `checkpoint` record how long each of its saves (every `every`
    steps) blocks training, its snapshot included (this instance only; the
    class is unchanged). Nothing is waited for first: a wait here would drain
    the device queue, which saves do not."""
    record: list[float] = []
    hook = checkpoint.on_step_end

    def timed(info) -> None:
        start = time.perf_counter()
        hook(info)
        if info.step % every == 0:
            record.append(time.perf_counter() - start)

    checkpoint.on_step_end = timed  # type: ignore[method-assign]
    return record


def lone_save(trainer, directory: pathlib.Path, n: int = 5) -> dict[str, float]:
    """Median seconds and CPU seconds of one save while nothing else runs."""
    checkpoint = px.callbacks.Checkpoint(directory, every_n_epochs=None, keep=2)
    blocking, total, cpu = [], [], []
    jax.block_until_ready(trainer.state)
    snapshot = trainer.snapshot()
    for i in range(n):
        # A new step folder each time (state unchanged).
        progress = dataclasses.replace(
            snapshot.progress, step=snapshot.progress.step + i + 1
        )
        cpu_start, start = cpu_seconds(), time.perf_counter()
        checkpoint.save_snapshot(dataclasses.replace(snapshot, progress=progress))
        blocking.append(time.perf_counter() - start)
        checkpoint.close()  # waits until the write is committed
        total.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - cpu_start)
    return {
        "save_call_s": statistics.median(blocking),
        "until_committed_s": statistics.median(total),
        "cpu_s": statistics.median(cpu),
    }


def state_bytes(trainer) -> int:
    leaves = jax.tree.leaves(trainer.state)
    return sum(
        int(np.prod(leaf.shape)) * leaf.dtype.itemsize
        for leaf in leaves
        if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(0)
    n = 64 * args.batch_size
    x = rng.normal(size=(n, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=n).astype(np.int32)
    loader = px.data.ArrayLoader((x, y), args.batch_size, seed=0)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = pathlib.Path(tmp)
        checkpoint = px.callbacks.Checkpoint(
            root / "run", every_n_steps=args.every, every_n_epochs=None
        )
        in_fit = timed_saves(checkpoint, args.every)
        trainers = {
            "none": make_trainer(args, []),
            "async_every": make_trainer(args, [checkpoint]),
        }
        # Warm-up (compiles); its length puts each save half a period away
        # from the end of a timed fit.
        warmup = args.every // 2 or 1
        for trainer in trainers.values():
            trainer.fit(loader, steps=warmup)
            jax.block_until_ready(trainer.state)

        in_fit.clear()  # the warm-up's
        times: dict[str, list[float]] = {name: [] for name in trainers}
        cpu: dict[str, list[float]] = {name: [] for name in trainers}
        for round_ in range(args.repeats):
            order = list(trainers) if round_ % 2 == 0 else list(trainers)[::-1]
            for name in order:
                start = cpu_seconds()
                times[name].append(timed_fit(trainers[name], loader, args.steps))
                cpu[name].append(cpu_seconds() - start)
            print(
                f"round {round_ + 1}/{args.repeats}: "
                + ", ".join(f"{k} {times[k][-1]:.3f}s" for k in trainers),
                file=sys.stderr,
            )
        saves = len(in_fit)
        save = lone_save(trainers["none"], root / "single")
        synced = synced_profile(args, loader, root / "synced")
        size = state_bytes(trainers["none"])

    median = {name: statistics.median(t) for name, t in times.items()}
    paired = [b / a for a, b in zip(times["none"], times["async_every"], strict=True)]
    slowdown = median["async_every"] / median["none"] - 1
    extra_per_save = (median["async_every"] - median["none"]) * args.repeats / saves
    cores = {name: sum(cpu[name]) / sum(times[name]) for name in trainers}
    results = {
        "config": {
            "model": f"MLP 784-{args.hidden.replace(',', '-')}-10",
            "optimizer": "adam",
            "batch_size": args.batch_size,
            "steps_per_fit": args.steps,
            "repeats": args.repeats,
            "save_every_steps": args.every,
            "saves_timed": saves,
            "state_bytes": size,
            "devices": [str(d) for d in jax.devices()],
            "jax": jax.__version__,
            "phalanx": px.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
        },
        "seconds": times,
        "median_seconds": median,
        "steps_per_sec": {k: args.steps / v for k, v in median.items()},
        "slowdown": slowdown,
        "paired_ratio_median": statistics.median(paired),
        "fastest_ratio": min(times["async_every"]) / min(times["none"]),
        "cpu_seconds": cpu,
        "extra_seconds_per_save": extra_per_save,
        "cores_busy": cores,
        "in_fit_save_call_median_s": statistics.median(in_fit),
        "in_fit_save_call_s": in_fit,
        "lone_save": save,
        "synced_profile": synced,
    }

    print(
        f"{results['config']['model']}, adam, batch {args.batch_size}, "
        f"{size / 2**20:.1f} MiB of state, on {len(jax.devices())} "
        f"{jax.devices()[0].platform} device(s); {args.steps} steps per fit, "
        f"median of {args.repeats}"
    )
    print(f"{'variant':<26}{'median s':>10}{'steps/s':>10}{'min s':>9}{'max s':>9}")
    labels = {"none": "no checkpoints", "async_every": f"save every {args.every}"}
    for name, label in labels.items():
        print(
            f"{label:<26}{median[name]:>10.3f}{args.steps / median[name]:>10.1f}"
            f"{min(times[name]):>9.3f}{max(times[name]):>9.3f}"
        )
    call = statistics.median(in_fit)
    step = median["none"] / args.steps
    print(
        f"slowdown {slowdown:+.1%} (median of paired ratios "
        f"{results['paired_ratio_median'] - 1:+.1%}, fastest fits "
        f"{results['fastest_ratio'] - 1:+.1%}), "
        f"{extra_per_save * 1e3:.0f} ms per save = {extra_per_save / step:.1f} steps"
    )
    print(
        f"per save, in training (median): {call * 1e3:.1f} ms in the save's hook "
        "(blocking)"
    )
    after = synced["async_every"]["after_save_ms"]
    print(
        f"waiting for the device every step: a step takes "
        f"{synced['async_every']['steady_step_ms']:.1f} ms, those after a save "
        + ", ".join(f"{ms:.0f}" for ms in after[:8])
        + f", ... ms: {synced['extra_ms_per_save']:.0f} ms more per save, "
        f"{synced['extra_ms_first_step']:.0f} of them in the first step"
    )
    print(
        f"a lone save: {save['save_call_s'] * 1e3:.1f} ms blocking, committed after "
        f"{save['until_committed_s'] * 1e3:.0f} ms, {save['cpu_s'] * 1e3:.0f} ms of "
        f"CPU; training keeps {cores['none']:.2f} of {os.cpu_count()} cores busy"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
