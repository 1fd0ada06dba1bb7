"""What the small benchmark scripts (`fsdp.py`, `precision.py`) share: their
common options, one process per fake device count, interleaved timing of
trainers, and the results file."""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any


def parse(
    argv: Sequence[str] | None,
    doc: str,
    *,
    out: str,
    tiny: dict[str, Any],
    defaults: dict[str, Any],
    extra: Sequence[tuple[str, type, str]] = (),
) -> argparse.Namespace:
    """A script's options: the common ones, then `extra` ((flag, type,
    help) each), those not given taken from `tiny` under ``--tiny``, else
    from `defaults`. ``--child N`` (internal) runs one device count."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--devices", help="device counts, comma-separated")
    for flag, kind, text in extra:
        parser.add_argument(flag, type=kind, help=text)
    parser.add_argument("--batch", type=int, help="global batch of the timing")
    parser.add_argument("--steps", type=int, help="steps per timed run")
    parser.add_argument("--repeats", type=int, help="timed runs per side")
    parser.add_argument("--out", default=out)
    parser.add_argument("--tiny", action="store_true", help="a smoke-test run")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, default in (tiny if args.tiny else defaults).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def write_json(path: str, data: Any) -> None:
    """`data` as JSON at `path` (its folder made if need be)."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))


def per_device_count(
    script: str, argv: Sequence[str] | None, counts: Sequence[int]
) -> list[dict[str, Any]]:
    """Run ``script ARGV --child N`` for each device count N (JAX fixes the
    fake CPU device count when it starts, so each count needs a process of
    its own; the child calls `px.fake_cpu_devices`, which sets ``NPROC``)
    and return the JSON each prints last.

    Raises:
        RuntimeError: a child failed (its output in the message).
    """
    results = []
    for n in counts:
        env = {k: v for k, v in os.environ.items() if k != "NPROC"}
        given = sys.argv[1:] if argv is None else argv
        command = [sys.executable, script, *given, "--child", str(n)]
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
