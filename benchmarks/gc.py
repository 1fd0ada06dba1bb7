"""What the trainer's ``gc=`` does to the long tail of step times (issue 33).

A callback allocates many small reference cycles after every step (as a
logging or metrics library might), and keeps a growing heap of live objects
(as a long run's history does). Under ``gc="python"`` Python's automatic
collector runs wherever the allocations cross its thresholds, and its
older-generation collections walk everything alive: some steps take many
times the median. Under ``gc="auto"`` the loop collects only at sync points
and the objects alive after the first step are frozen. Each step's time is
the host's time between two `on_step_end` calls (tiny model, one device);
a window's, that of the 16 steps between two sync points (the loop's
``sync_every``), where ``"auto"`` collects once.

Usage:
    python benchmarks/gc.py [--steps 2000] [--cycles 2000] [--tiny]
"""

import argparse
import gc
import os
import statistics
import time

import jax


os.environ.setdefault("NPROC", "16")
jax.config.update("jax_num_cpu_devices", 1)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from typing_extensions import override  # noqa: E402

import phalanx as px  # noqa: E402


class Cycles(px.Callback):
    """Makes `cycles` garbage reference cycles and keeps one live object
    after each step, and notes the time between steps."""

    def __init__(self, cycles: int):
        self.cycles = cycles
        self.kept: list[dict] = []
        self.times: list[float] = []
        self._last = 0.0

    @override
    def on_step_end(self, info):
        for _ in range(self.cycles):
            a: list = []
            a.append(a)
        self.kept.append({"step": info.step})
        now = time.perf_counter()
        if self._last:
            self.times.append(now - self._last)
        self._last = now


def run(mode: str, steps: int, cycles: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype(np.float32)
    y = rng.integers(0, 4, size=64).astype(np.int32)
    watch = Cycles(cycles)
    trainer = px.DataParallelTrainer(
        px.models.MLP(16, 4, hidden=(16,), key=jax.random.key(0)),
        optax.adam(1e-3),
        strategy=px.ShardingStrategy(1),
        callbacks=[watch],
        gc=mode,  # pyright: ignore[reportArgumentType]
        progress=False,
        slow_steps=None,
    )
    trainer.fit([(x, y)], steps=2)  # compiled outside the measured run
    ballast = [[i] for i in range(300_000)]  # a big live heap, as a long run's
    watch.times, watch._last = [], 0.0
    trainer.fit([(x, y)] * steps, epochs=1)
    del ballast
    times = watch.times[16:]
    # A window of `sync_every` steps: the loop collects once in each.
    windows = [sum(times[i : i + 16]) for i in range(0, len(times) - 15, 16)]
    return {
        **{f"step_{k}": v for k, v in quantiles(times).items()},
        **{f"window_{k}": v for k, v in quantiles(windows).items()},
    }


def quantiles(times: list[float]) -> dict[str, float]:
    """Median, 99th percentile and maximum, in milliseconds."""
    times = sorted(times)
    p99 = times[int(0.99 * (len(times) - 1))]
    return {
        "p50_ms": statistics.median(times) * 1e3,
        "p99_ms": p99 * 1e3,
        "max_ms": times[-1] * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--tiny", action="store_true", help="smoke run: 60 steps")
    args = parser.parse_args()
    steps, cycles = (60, 200) if args.tiny else (args.steps, args.cycles)
    for mode in ("python", "auto"):
        gc.collect()
        r = run(mode, steps, cycles)
        for unit in ("step", "window"):
            p50, p99, top = (r[f"{unit}_{k}_ms"] for k in ("p50", "p99", "max"))
            print(
                f"gc={mode!r:9} {unit:6}  p50 {p50:8.3f} ms  p99 {p99:8.3f} ms  "
                f"p99/p50 {p99 / p50:5.1f}  max {top:7.1f} ms"
            )


if __name__ == "__main__":
    main()
