"""What the small benchmark scripts (`fsdp.py`, `precision.py`) share: one
process per fake device count, and interleaved timing of trainers."""

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any


def per_device_count(
    script: str, passed: Sequence[str], counts: Sequence[int]
) -> list[dict[str, Any]]:
    """Run ``script ... --child N`` for each device count N (JAX fixes the
    fake CPU device count when it starts, so each count needs a process of
    its own; the child calls `px.fake_cpu_devices`, which sets ``NPROC``)
    and return the JSON each prints last.

    Raises:
        RuntimeError: a child failed (its output in the message).
    """
    results = []
    for n in counts:
        env = {k: v for k, v in os.environ.items() if k != "NPROC"}
        command = [sys.executable, script, *passed, "--child", str(n)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{command} failed:\n{done.stdout}{done.stderr}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


def interleaved(
    trainers: dict[str, Any], data: list[Any], repeats: int
) -> dict[str, Any]:
    """Seconds per step of each trainer over `data` (one epoch a run),
    `repeats` runs each, interleaved (A B A B ...) so that drifts of the
    machine's speed fall on all alike; their medians."""
    for trainer in trainers.values():
        trainer.fit(data[:2], epochs=1)  # compiled, warm
    seconds: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(repeats):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.fit(data, epochs=1)
            seconds[name].append((time.perf_counter() - start) / len(data))
    return {
        "seconds": seconds,
        "median_s": {name: statistics.median(s) for name, s in seconds.items()},
    }
