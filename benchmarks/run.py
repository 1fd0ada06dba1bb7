"""phalanx against hand-written JAX loops, side by side (issue 5).

Each case pairs two sides, A and B, on the same MLP 784-256-128-10 with
adam(1e-3) and synthetic data, on fake CPU devices, one process per device
count (`run_each_device_count`):

- ``sharding``, ``pmap``, ``accum-sharding``, ``accum-pmap``: a phalanx
  strategy (A) against its hand-written reference (B) from `references.py`
  (``jit``, ``pmap``, and the ``shard_map`` local scan with 4 microbatches for
  both `AccumulatingStrategy` variants), for every device count, global
  batch size and data source: ``device`` (batches already placed on the
  devices) or ``host`` (NumPy through `px.data.ArrayLoader`, placed each
  step);
- ``steps-per-call``: the trainer with ``steps_per_call=8`` (`STEPS_PER_CALL`:
  eight steps per compiled call) against the ``jit`` reference stepping one
  batch per call, for every data source (steps per run rounded up to whole
  calls);
- ``checks``: the same trainer with value checks on (A) and off (B), host data;
- ``nan-guard``: the same trainer with the default ``nan_policy="raise"`` (A)
  and ``"off"`` (B), device data: what the non-finite gradient guard costs;
- ``timeline``: the same trainer with a `px.callbacks.Timeline` (A, no
  table) and without (B), host data: what the goodput breakdown costs (the
  phase clock itself is always on: the slow-step alarm reads it);
- ``guard-vs-optax``: the trainer (A) against the ``jit`` reference guarded
  as a hand-written loop would be, with ``optax.apply_if_finite`` (B,
  ``"jit-guarded"``), device data (no target);
- ``host-vs-device``: the same trainer fed from the host loader (A) and with
  the loader's whole dataset already on the devices (B, its `HOST_BATCHES`
  batches placed once): the same epochs (each ends with the epoch's logs,
  which wait for the device) and as many distinct examples, so only where
  the batches come from differs. (Cycling through `DEVICE_BATCHES` batches
  instead would let side B's data stay in the CPU's cache at batch 2048.)
- ``jit-host-vs-device``: the same comparison for the ``jit`` reference, fed
  in its loop from the same loader (A) and from the loader's dataset placed
  once (B): what host data costs a hand-written loop on this machine, the
  floor for ``host-vs-device`` (no target).

What is measured, per side (a trainer or reference is built once per device
count and batch size and serves every case it appears in):

- time to first step, from nothing: build the model and the trainer or
  reference, place the device batches, make one step, wait for it; the
  median of `--first-step-repeats` builds, each after `jax.clear_caches()`
  (so each traces and compiles afresh), after a warm-up (so no build pays
  JAX's one-off set-up);
- `--repeats` timed runs of the same number of steps, the sides alternating
  (AB, BA, ...), each timed until `jax.block_until_ready` on the state
  returns, by the clock and by the process's CPU time (every thread). The
  steps are `--steps`, or else as many as side B makes in about
  `--run-seconds` (the fastest of 3 short untimed runs, at least
  `MIN_STEPS`), so that a `fit` call's fixed cost is not what is measured;
- the train step traced and lowered, then compiled, afresh (after
  `jax.clear_caches()`; the median of `--first-step-repeats`): the seconds
  of each, and the compiled step's per-device `memory_analysis()`;
- the process's peak RSS after each case.

The table shows medians (A/B: of the rounds' own ratios); the JSON file
(`--out`) holds every timing too. Also reported (``memory``), on each device
count at the largest batch: the compiled step's temporary memory under
`AccumulatingStrategy` with 1 (the plain inner strategy), 4 and 16
microbatches, and the same for the ``shard_map`` scan reference.

``--model tiny`` runs every case on an MLP 16-16-4 instead (batch 64 in issue
17's runs): steps of tens of µs, as small models take on an accelerator, where
the host's work per step is the speed; `TINY_TARGETS` are its targets.

Usage:
    python benchmarks/run.py [--cases sharding,pmap,...] [--repeats 5]
        [--steps N | --run-seconds 1.0] [--devices 1,8] [--batch-sizes 256,2048]
        [--data device,host] [--model mlp|tiny] [--out benchmarks/results.json]
        [--tiny]
"""

import argparse
import dataclasses
import functools
import itertools
import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from rich.console import Console
from rich.table import Table

import phalanx as px
import references
from references import SIZES, make_model, make_optimizer, make_reference


PAIRS = ("sharding", "pmap", "accum-sharding", "accum-pmap")
HOST_CASES = ("host-vs-device", "jit-host-vs-device")
CASES = (
    *PAIRS,
    "steps-per-call",
    "checks",
    "nan-guard",
    "timeline",
    "guard-vs-optax",
    *HOST_CASES,
    "memory",
)
MICROBATCHES = 4  # of the accumulation cases
STEPS_PER_CALL = 8  # of the "steps-per-call" case
MEMORY_MICROBATCHES = (1, 4, 16)  # of the memory report (1: the plain inner)
DEVICE_BATCHES = 4  # distinct batches cycled through in "device" runs
HOST_BATCHES = 16  # batches in an epoch of the host loader
# Issue 5's acceptance: the least ratio A/B of steps per second, per case.
TARGETS = {
    "sharding": 0.97,
    "pmap": 0.97,
    "accum-sharding": 0.95,
    "accum-pmap": 0.95,
    "checks": 0.98,
    "timeline": 0.98,
    "host-vs-device": 0.95,
}
# Issue 17's, with --model tiny: the least ratio per case and device count.
TINY_TARGETS = {("sharding", 1): 0.97, ("sharding", 8): 0.97}
TINY_TARGETS |= {("steps-per-call", 1): 2.0, ("steps-per-call", 8): 1.0}
TINY_TARGETS |= {("timeline", 1): 0.97, ("timeline", 8): 0.97}
FIRST_STEP_TARGET = 1.2  # time to first step, A/B, at most
MIN_STEPS = 10  # per timed run, when chosen from --run-seconds
CALIBRATION_STEPS = 16  # one loader epoch: a fit call's fixed cost spread as in a run
CALIBRATIONS = 3  # short runs of side B, the fastest sets the steps per run
TINY = {
    "repeats": 1,
    "first_step_repeats": 1,
    "steps": 3,
    "devices": "2",
    "batch_sizes": "64",
}
DEFAULTS = {
    "repeats": 5,
    "first_step_repeats": 3,
    "devices": "1,8",
    "batch_sizes": "256,2048",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated, from {CASES}"
    )
    parser.add_argument("--repeats", type=int, help="timed runs per side (5)")
    parser.add_argument(
        "--first-step-repeats",
        type=int,
        help="builds timed per side for the time to first step (3)",
    )
    parser.add_argument("--steps", type=int, help="steps per timed run")
    parser.add_argument(
        "--run-seconds",
        type=float,
        default=1.0,
        help="without --steps: steps per run chosen to take about this long (1.0)",
    )
    parser.add_argument("--devices", help="device counts, comma-separated (1,8)")
    parser.add_argument("--batch-sizes", help="global batch sizes (256,2048)")
    parser.add_argument("--data", default="device,host", help="device,host")
    parser.add_argument(
        "--nan-policy",
        choices=("raise", "skip", "off"),
        default="raise",
        help="the phalanx sides' nan_policy (raise: the default guard; off: "
        "what the step costs without it); not with nan-guard or guard-vs-optax",
    )
    parser.add_argument(
        "--model",
        choices=tuple(SIZES),
        default="mlp",
        help="mlp: 784-256-128-10 (steps of milliseconds here); tiny: 16-16-4 "
        "(steps of tens of µs: the host's work per step is the speed)",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path(__file__).with_name("results.json"),
        help="where the JSON results go",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="CI smoke run: 1 repeat of 3 steps, 2 devices, batch 64 "
        "(options given explicitly still win; the model is --model's)",
    )
    args = parser.parse_args(argv)
    for name, default in (TINY if args.tiny else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.cases = _names(parser, "cases", args.cases, CASES)
    args.data = _names(parser, "data", args.data, ("device", "host"))
    args.devices = _ints(parser, "devices", args.devices)
    guards = {"nan-guard", "guard-vs-optax"} & set(args.cases)
    if args.nan_policy != "raise" and guards:
        cases = ", ".join(sorted(guards))
        parser.error(f"--nan-policy: the {cases} case(s) set their own")
    args.batch_sizes = _ints(parser, "batch-sizes", args.batch_sizes)
    if (
        min(args.repeats, args.first_step_repeats, args.steps or 1) < 1
        or args.run_seconds <= 0
    ):
        parser.error(
            "--repeats, --first-step-repeats, --steps and --run-seconds must be "
            "positive"
        )
    microbatches = max(
        [1]
        + [MICROBATCHES for c in args.cases if c.startswith("accum")]
        + [max(MEMORY_MICROBATCHES) for c in args.cases if c == "memory"]
    )
    multiple = max(args.devices) * microbatches
    for batch in args.batch_sizes:
        if batch % multiple:
            parser.error(
                f"batch size {batch} must be a multiple of {multiple} (the most "
                f"devices × {microbatches} microbatches)"
            )
    return args


def _names(parser, option: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    names = [name for name in value.split(",") if name]
    unknown = sorted(set(names) - set(allowed))
    if unknown or not names:
        parser.error(f"--{option} {value!r}: choose from {','.join(allowed)}")
    return names


def _ints(parser, option: str, value: str) -> list[int]:
    try:
        numbers = [int(part) for part in value.split(",")]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < 1:
        parser.error(f"--{option} {value!r} must be positive ints, e.g. 1,8")
    return numbers


# ------------------------------------------------------------------ the data


@functools.cache
def dataset(batch: int) -> tuple[np.ndarray, np.ndarray]:
    """`HOST_BATCHES` batches of random features and labels."""
    rng = np.random.default_rng(0)
    n = HOST_BATCHES * batch
    size = references.SIZE
    x = rng.normal(size=(n, size.inputs)).astype(np.float32)
    return x, rng.integers(0, size.classes, size=n).astype(np.int32)


def host_batches(
    batch: int, count: int = DEVICE_BATCHES
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The dataset's first `count` batches: by default the `DEVICE_BATCHES`
    that "device" runs place once and reuse; `HOST_BATCHES` is all of it."""
    x, y = dataset(batch)
    return [
        (x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch])
        for i in range(count)
    ]


def loader(batch: int) -> px.data.ArrayLoader:
    """A shuffling host loader over the dataset (same seed on both sides)."""
    return px.data.ArrayLoader(dataset(batch), batch, seed=0)


def forever(data: px.data.ArrayLoader) -> Iterator[tuple[np.ndarray, ...]]:
    while True:
        yield from data


# ----------------------------------------------------------------- the sides


def memory_stats(compiled: jax.stages.Compiled) -> dict[str, int] | None:
    """XLA's per-device memory figures for a compiled step (None if unknown)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return {
        "temp_bytes": stats.temp_size_in_bytes,
        "argument_bytes": stats.argument_size_in_bytes,
        "output_bytes": stats.output_size_in_bytes,
        "generated_code_bytes": stats.generated_code_size_in_bytes,
    }


@dataclasses.dataclass(frozen=True)
class Timing:
    """A timed run: seconds on the clock, and CPU seconds of every thread of
    the process (XLA's included) over the same span."""

    wall: float
    cpu: float


class Stopwatch:
    """Started on creation; `read` gives the `Timing` since then."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> Timing:
        return Timing(time.perf_counter() - self.wall, time.process_time() - self.cpu)


class Side:
    """One trainer or reference loop, built once and fed either kind of data.

    `start` builds it from nothing and makes its first step (timed `repeats`
    times from empty caches, then remembered); `run` times `steps` steps
    from ``"device"`` batches (placed once, cycled through), from the
    ``"host"`` loader (placed every step), or from ``"device-epochs"``: the
    loader's whole dataset, placed once.
    """

    def __init__(self, batch: int, repeats: int):
        self.batch = batch
        self.repeats = repeats  # builds timed for the time to first step
        self.first_step_s: float | None = None
        self._compiled: dict[str, Any] | None = None
        self._dataset: list[Any] | None = None

    def start(self) -> float:
        """Seconds to build, place the device batches and finish step one."""
        if self.first_step_s is None:
            dataset(self.batch)  # made before the clock starts
            times = []
            for _ in range(self.repeats):
                jax.clear_caches()
                self._dataset = None  # placed afresh for each build
                start = time.perf_counter()
                self.build()
                times.append(time.perf_counter() - start)
            self.first_step_s = statistics.median(times)
        return self.first_step_s

    def compiled(self) -> dict[str, Any]:
        """The train step traced and lowered, then compiled, from empty caches
        (`repeats` times): the median seconds of each, and its memory."""
        if self._compiled is None:
            lowering, compiling = [], []
            for _ in range(self.repeats):
                jax.clear_caches()
                clock = Stopwatch()
                lowered = self.lower()
                lowering.append(clock.read().wall)
                clock = Stopwatch()
                compiled = lowered.compile()
                compiling.append(clock.read().wall)
            self._compiled = {
                "lower_s": statistics.median(lowering),
                "compile_s": statistics.median(compiling),
                "memory": memory_stats(compiled),
            }
        return self._compiled

    def placed_dataset(self) -> list[Any]:
        """The loader's whole dataset, placed once (``"device-epochs"``)."""
        if self._dataset is None:
            self._dataset = self.place(host_batches(self.batch, HOST_BATCHES))
        return self._dataset

    def build(self) -> None:
        raise NotImplementedError

    def place(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> list[Any]:
        """Host batches placed on the devices as this side's step takes them."""
        raise NotImplementedError

    def run(self, steps: int, feed: str) -> Timing:
        raise NotImplementedError

    def lower(self) -> jax.stages.Lowered:
        """The train step lowered for one of the device batches."""
        raise NotImplementedError


class PhalanxSide(Side):
    """A `DataParallelTrainer`, timed through `fit(data, steps=S)` until the
    state is ready."""

    def __init__(
        self, make_strategy: Callable[[], px.Strategy], batch: int, repeats: int, **kw
    ):
        super().__init__(batch, repeats)
        self.make_strategy = make_strategy
        self.kwargs = kw  # e.g. checks="off"

    def build(self) -> None:
        self.trainer = px.DataParallelTrainer(
            make_model(),
            make_optimizer(),
            strategy=self.make_strategy(),
            progress=False,
            **self.kwargs,
        )
        self.placed = self.place(host_batches(self.batch))
        self.loader = loader(self.batch)
        self.run(1, "device")

    def place(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> list[Any]:
        return jax.device_put(batches, self.trainer.strategy.batch_sharding)

    def run(self, steps: int, feed: str) -> Timing:
        if feed == "host":
            data = self.loader  # stateful: each fit resumes where the last stopped
        elif feed == "device-epochs":
            data = self.placed_dataset()
        else:
            data = [self.placed[i % len(self.placed)] for i in range(steps)]
        clock = Stopwatch()
        self.trainer.fit(data, steps=steps)
        jax.block_until_ready(self.trainer.state)
        return clock.read()

    def lower(self) -> jax.stages.Lowered:
        return self.trainer.lower(host_batches(self.batch)[0])


class ReferenceSide(Side):
    """A hand-written loop from `references.py`, stepped in a plain for loop
    (no waiting) until the state is ready."""

    def __init__(
        self, kind: str, devices: int, batch: int, repeats: int, microbatches: int = 1
    ):
        super().__init__(batch, repeats)
        self.kind, self.devices, self.microbatches = kind, devices, microbatches

    def build(self) -> None:
        devices = jax.devices()[: self.devices]
        self.reference = make_reference(
            self.kind, devices, self.batch, self.microbatches
        )
        self.placed = self.place(host_batches(self.batch))
        self.host = forever(loader(self.batch))
        self.run(1, "device")

    def place(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> list[Any]:
        return [self.reference.place(*batch) for batch in batches]

    def run(self, steps: int, feed: str) -> Timing:
        placed = self.placed_dataset() if feed == "device-epochs" else self.placed
        clock = Stopwatch()
        for i in range(steps):
            if feed == "host":
                x, y, _ = next(self.host)  # weights are all 1: no short batches
                batch = self.reference.place(x, y)
            else:
                batch = placed[i % len(placed)]
            self.reference.step(batch)
        self.reference.block()
        return clock.read()

    def lower(self) -> jax.stages.Lowered:
        return self.reference.lower(self.placed[0])


# ----------------------------------------------------------------- the cases


@dataclasses.dataclass
class Case:
    """Side A fed `a_feed` against side B fed `b_feed`."""

    name: str
    devices: int
    batch: int
    data: str
    a_label: str
    a: Side
    a_feed: str
    b_label: str
    b: Side
    b_feed: str


def make_strategy(name: str, devices: int) -> Callable[[], px.Strategy]:
    inner = px.PmapStrategy if name.endswith("pmap") else px.ShardingStrategy
    if name.startswith("accum"):
        return lambda: px.AccumulatingStrategy(inner(devices), MICROBATCHES)
    return lambda: inner(devices)


LABELS = {  # case: (phalanx side, reference side)
    "sharding": ("ShardingStrategy", "jax.jit"),
    "pmap": ("PmapStrategy", "jax.pmap"),
    "accum-sharding": (f"Accum(Sharding, {MICROBATCHES})", "shard_map scan"),
    "accum-pmap": (f"Accum(Pmap, {MICROBATCHES})", "shard_map scan"),
}
REFERENCE_KINDS = {"sharding": "jit", "pmap": "pmap"}  # the rest: "scan"


def cell_cases(args: argparse.Namespace, n: int, batch: int) -> list[Case]:
    """Every case on `n` devices at global batch `batch`; a trainer or
    reference serves every case it appears in (built and compiled once)."""
    cases = []
    references: dict[str, Side] = {}
    repeats = args.first_step_repeats
    policy = {"nan_policy": args.nan_policy}
    trainers = {
        name: PhalanxSide(make_strategy(name, n), batch, repeats, **policy)
        for name in PAIRS
    }
    for name in [c for c in args.cases if c in PAIRS]:
        kind = REFERENCE_KINDS.get(name, "scan")
        if kind not in references:
            k = MICROBATCHES if kind == "scan" else 1
            references[kind] = ReferenceSide(kind, n, batch, repeats, k)
        a_label, b_label = LABELS[name]
        for feed in args.data:
            a, b = trainers[name], references[kind]
            cases.append(Case(name, n, batch, feed, a_label, a, feed, b_label, b, feed))
    sharding = trainers["sharding"]
    if "steps-per-call" in args.cases:
        many = PhalanxSide(
            make_strategy("sharding", n),
            batch,
            repeats,
            steps_per_call=STEPS_PER_CALL,
            **policy,
        )
        jit = references.get("jit") or ReferenceSide("jit", n, batch, repeats)
        references["jit"] = jit
        for feed in args.data:
            labels = (f"steps_per_call={STEPS_PER_CALL}", many, feed, "jax.jit", jit)
            cases.append(Case("steps-per-call", n, batch, feed, *labels, feed))
    if "checks" in args.cases:
        off = PhalanxSide(
            make_strategy("sharding", n), batch, repeats, checks="off", **policy
        )
        labels = ("checks on", sharding, "host", "checks off", off, "host")
        cases.append(Case("checks", n, batch, "host", *labels))
    if "nan-guard" in args.cases:
        off = PhalanxSide(
            make_strategy("sharding", n), batch, repeats, nan_policy="off"
        )
        labels = ("nan_policy raise", sharding, "device", "nan_policy off", off)
        cases.append(Case("nan-guard", n, batch, "device", *labels, "device"))
    if "timeline" in args.cases:
        timeline = PhalanxSide(
            make_strategy("sharding", n),
            batch,
            repeats,
            callbacks=[px.callbacks.Timeline(table=False)],
            **policy,
        )
        labels = ("Timeline", timeline, "host", "no Timeline", sharding, "host")
        cases.append(Case("timeline", n, batch, "host", *labels))
    if "guard-vs-optax" in args.cases:
        guarded = ReferenceSide("jit-guarded", n, batch, repeats)
        labels = ("ShardingStrategy", sharding, "device", "jit + apply_if_finite")
        labels = (*labels, guarded, "device")
        cases.append(Case("guard-vs-optax", n, batch, "device", *labels))
    if "host-vs-device" in args.cases:
        labels = ("host loader", sharding, "host", "on device", sharding)
        labels = (*labels, "device-epochs")
        cases.append(Case("host-vs-device", n, batch, "both", *labels))
    if "jit-host-vs-device" in args.cases:
        jit = references.get("jit") or ReferenceSide("jit", n, batch, repeats)
        labels = ("jax.jit, host loader", jit, "host", "jax.jit, on device", jit)
        labels = (*labels, "device-epochs")
        cases.append(Case("jit-host-vs-device", n, batch, "both", *labels))
    return cases


def max_rss_mib() -> float:
    """The process's peak resident memory so far (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def steps_per_run(case: Case, seconds: float) -> int:
    """As many steps as side B makes in about `seconds` (at least `MIN_STEPS`),
    from the fastest of `CALIBRATIONS` short untimed runs of it (one slow
    run, a hiccup or the last of a build's one-off costs, made every timed
    run of the case half as long in earlier runs: 48 steps instead of 83)."""
    fastest = min(
        case.b.run(CALIBRATION_STEPS, case.b_feed).wall for _ in range(CALIBRATIONS)
    )
    steps = max(MIN_STEPS, round(seconds / (fastest / CALIBRATION_STEPS)))
    # Whole calls of the "steps-per-call" case (and the same steps for all).
    return -(-steps // STEPS_PER_CALL) * STEPS_PER_CALL


def target(case: Case) -> float | None:
    """The least ratio A/B `case` must reach, if it has a target."""
    if references.SIZE == SIZES["tiny"]:
        return TINY_TARGETS.get((case.name, case.devices))
    return TARGETS.get(case.name)


def measure(case: Case, repeats: int, steps: int | None, seconds: float) -> dict:
    """Time to first step of each side, then alternating timed runs."""
    sides = {"a": (case.a, case.a_feed), "b": (case.b, case.b_feed)}
    labels = {"a": case.a_label, "b": case.b_label}
    first = {key: side.start() for key, (side, _) in sides.items()}
    for side, feed in sides.values():  # compiled again after clear_caches
        side.run(1, feed)
    steps = steps or steps_per_run(case, seconds)
    timings: dict[str, list[Timing]] = {"a": [], "b": []}
    for round_ in range(repeats):
        for key in ("a", "b") if round_ % 2 == 0 else ("b", "a"):
            side, feed = sides[key]
            timings[key].append(side.run(steps, feed))
    seconds = {key: [t.wall for t in runs] for key, runs in timings.items()}
    cpu = {key: [t.cpu for t in runs] for key, runs in timings.items()}
    result: dict[str, Any] = {
        "case": case.name,
        "devices": case.devices,
        "batch": case.batch,
        "data": case.data,
        "steps": steps,
    }
    for key, (side, feed) in sides.items():
        median = statistics.median(seconds[key])
        result[key] = {
            "label": labels[key],
            "feed": feed,
            "first_step_s": first[key],
            "seconds": seconds[key],
            "median_s": median,
            "steps_per_s": steps / median,
            "examples_per_s": steps * case.batch / median,
            "cpu_seconds": cpu[key],
            "cpu_median_s": statistics.median(cpu[key]),
            **side.compiled(),  # lower_s, compile_s, memory
        }
    a, b = result["a"], result["b"]
    result["ratio"] = a["steps_per_s"] / b["steps_per_s"]
    # The median of the rounds' own ratios (A and B run back to back): what
    # the table shows. A slow phase of a shared machine spans both runs of a
    # round, but can catch more of one side's runs than the other's and so
    # skew the ratio of the medians (1.36 against 0.96 in one case here).
    paired = [tb / ta for ta, tb in zip(seconds["a"], seconds["b"], strict=True)]
    result["paired_ratio_median"] = statistics.median(paired)
    # The same ratio by CPU time (work per step): steadier than the clock on
    # a shared machine, but blind to work a side hides on idle cores.
    result["cpu_ratio"] = b["cpu_median_s"] / a["cpu_median_s"]
    result["first_step_ratio"] = a["first_step_s"] / b["first_step_s"]
    result["target"] = target(case)  # None: reported, no target
    result["max_rss_mib"] = max_rss_mib()
    return result


def accumulation_memory(devices: int, batch: int) -> list[dict[str, Any]]:
    """Temporary memory of the compiled step against the microbatch count."""
    rows = []
    x, y = host_batches(batch)[0]
    for inner in (px.ShardingStrategy, px.PmapStrategy):
        for k in MEMORY_MICROBATCHES:
            strategy = inner(devices)
            if k > 1:
                strategy = px.AccumulatingStrategy(strategy, k)
            model, optimizer = make_model(), make_optimizer()
            trainer = px.DataParallelTrainer(
                model, optimizer, strategy=strategy, progress=False
            )
            stats = memory_stats(trainer.lower((x, y)).compile())
            rows.append({"side": inner.__name__, "microbatches": k, "memory": stats})
    for k in MEMORY_MICROBATCHES:
        reference = make_reference("scan", jax.devices()[:devices], batch, k)
        stats = memory_stats(reference.compile(reference.place(x, y)))
        rows.append({"side": "shard_map scan", "microbatches": k, "memory": stats})
    return [{"devices": devices, "batch": batch, **row} for row in rows]


# ------------------------------------------------------------------ reporting


def configuration(args: argparse.Namespace) -> dict[str, Any]:
    devices = jax.devices()
    return {
        "model": references.SIZE.describe(),
        "steps_per_call": STEPS_PER_CALL,
        "nan_policy": args.nan_policy,
        "optimizer": "adam(1e-3)",
        "cases": args.cases,
        "repeats": args.repeats,
        "steps": args.steps or f"~{args.run_seconds} s per run",
        "devices": args.devices,
        "batch_sizes": args.batch_sizes,
        "data": args.data,
        "microbatches": MICROBATCHES,
        "device_batches": DEVICE_BATCHES,
        "host_batches_per_epoch": HOST_BATCHES,
        "platform": devices[0].platform,
        "device_count": len(devices),
        "cpu_count": os.cpu_count(),
        "NPROC": os.environ.get("NPROC"),
        "jax": jax.__version__,
        "equinox": eqx.__version__,
        "optax": optax.__version__,
        "phalanx": px.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def _mib(memory: dict[str, int] | None, key: str = "temp_bytes") -> str:
    return "?" if memory is None else f"{memory[key] / 2**20:.2f}"


def _ratio(value: float, ok: bool) -> str:
    return f"[{'green' if ok else 'red'}]{value:.3f}[/]"


def cases_table(results: list[dict[str, Any]], config: dict[str, Any]) -> Table:
    table = Table(
        title=f"A vs B, medians of {config['repeats']} runs each; "
        f"{config['model']}, {config['optimizer']}, "
        f"{config['platform']} ×{config['device_count']} (NPROC {config['NPROC']})",
    )
    for name in ("case", "A", "B", "dev", "batch", "data"):
        table.add_column(name)
    numbers = ("steps", "A steps/s", "B steps/s", "A/B", "target", "A/B cpu", "A ex/s")
    for name in numbers:
        table.add_column(name, justify="right")
    for name in ("1st step A s", "B s", "A/B", "compile A s", "B s"):
        table.add_column(name, justify="right")
    for name in ("temp MiB A", "B"):
        table.add_column(name, justify="right")
    for r in results:
        a, b, paired = r["a"], r["b"], r["paired_ratio_median"]
        table.add_row(
            r["case"],
            a["label"],
            b["label"],
            str(r["devices"]),
            str(r["batch"]),
            r["data"],
            str(r["steps"]),
            f"{a['steps_per_s']:.1f}",
            f"{b['steps_per_s']:.1f}",
            _ratio(paired, r["target"] is None or paired >= r["target"]),
            "–" if r["target"] is None else f"≥ {r['target']}",
            f"{r['cpu_ratio']:.3f}",
            f"{a['examples_per_s']:,.0f}",
            f"{a['first_step_s']:.2f}",
            f"{b['first_step_s']:.2f}",
            _ratio(r["first_step_ratio"], r["first_step_ratio"] <= FIRST_STEP_TARGET),
            f"{a['compile_s']:.2f}",
            f"{b['compile_s']:.2f}",
            _mib(a["memory"]),
            _mib(b["memory"]),
        )
    return table


def memory_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="compiled step memory per device (k=1: no accumulation)")
    for name in ("step", "dev", "batch"):
        table.add_column(name)
    for name in ("k", "temp MiB", "vs k=1", "argument MiB"):
        table.add_column(name, justify="right")
    for row in rows:
        memory = row["memory"]
        plain = next(
            r["memory"]
            for r in rows
            if (r["side"], r["devices"], r["microbatches"])
            == (row["side"], row["devices"], 1)
        )
        relative = "?"
        if memory is not None and plain is not None and plain["temp_bytes"]:
            relative = f"{memory['temp_bytes'] / plain['temp_bytes']:.2f}"
        table.add_row(
            row["side"],
            str(row["devices"]),
            str(row["batch"]),
            str(row["microbatches"]),
            _mib(memory),
            relative,
            _mib(memory, "argument_bytes"),
        )
    return table


# ----------------------------------------------------------------------- main


def warm_up(device_counts: list[int]) -> None:
    """Start JAX and run each kind of step once on every device count, on a
    shape no case uses, so no time to first step holds one-off set-up."""
    for n in device_counts:
        rows = 16 * n
        x = np.zeros((rows, references.SIZE.inputs), np.float32)
        y = np.zeros(rows, np.int32)
        trainer = px.DataParallelTrainer(
            make_model(), make_optimizer(), strategy=px.ShardingStrategy(n)
        )
        trainer.fit([(x, y)], steps=1)
        reference = make_reference("jit", jax.devices()[:n], rows)
        reference.step(reference.place(x, y))
        reference.block()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    references.use_size(args.model)
    if len(args.devices) > 1:
        return run_each_device_count(argv, args)
    # Before JAX starts: the fake devices, and NPROC (XLA:CPU collectives
    # need two pool threads per device, or they abort: docs/architecture.md).
    px.fake_cpu_devices(max(args.devices))
    if len(jax.devices()) < max(args.devices):
        print(
            f"--devices {max(args.devices)}: only {len(jax.devices())} "
            f"{jax.devices()[0].platform} device(s) here",
            file=sys.stderr,
        )
        return 2
    config = configuration(args)
    warm_up(args.devices)
    results = []
    for n, batch in itertools.product(args.devices, args.batch_sizes):
        for case in cell_cases(args, n, batch):
            start = time.perf_counter()
            result = measure(case, args.repeats, args.steps, args.run_seconds)
            results.append(result)
            print(
                f"[{len(results)}] {case.name}, {n} device(s), batch {batch}, "
                f"{case.data}, {result['steps']} steps: "
                f"A/B {result['paired_ratio_median']:.3f} "
                f"({time.perf_counter() - start:.1f}s)",
                file=sys.stderr,
            )
    memory: list[dict[str, Any]] = []
    if "memory" in args.cases:
        for n in args.devices:
            memory += accumulation_memory(n, max(args.batch_sizes))
    output = {
        "config": config,
        "cases": results,
        "accumulation_memory": memory,
        "max_rss_mib": max_rss_mib(),
    }
    report(output, args.out)
    return 0


def run_each_device_count(argv: list[str], args: argparse.Namespace) -> int:
    """Each device count in a process of its own, then one report.

    A process fakes its devices and sets `NPROC` (XLA's CPU thread count)
    once, before JAX starts, and NPROC must be at least twice the devices
    (or XLA:CPU's collectives can starve its thread pool and abort; see
    "JAX on CPU" in docs/architecture.md): in a process set up for 8 devices a 1-device
    step runs 16 threads on this machine's 2 cores, ~1.5x slower than in a
    process of its own (NPROC=2, what `fake_cpu_devices(1)` sets), on both
    sides alike. So each count runs as a user of that many devices would.
    """
    outputs = []
    with tempfile.TemporaryDirectory() as folder:
        for n in args.devices:
            out = pathlib.Path(folder) / f"{n}.json"
            # Later options win: this count only, into its own file.
            command = [*argv, "--devices", str(n), "--out", str(out)]
            child = subprocess.run(
                [sys.executable, __file__, *command], stdout=subprocess.DEVNULL
            )
            if child.returncode:
                return child.returncode
            outputs.append(json.loads(out.read_text()))
    config = dict(outputs[0]["config"], devices=args.devices)
    for key in ("device_count", "NPROC"):  # per process, e.g. "1/8"
        config[key] = "/".join(str(output["config"][key]) for output in outputs)
    output = {
        "config": config,
        "cases": [case for output in outputs for case in output["cases"]],
        "accumulation_memory": [
            row for output in outputs for row in output["accumulation_memory"]
        ],
        "max_rss_mib": max(output["max_rss_mib"] for output in outputs),
    }
    report(output, args.out)
    return 0


def report(output: dict[str, Any], out: pathlib.Path) -> None:
    """Write the results as JSON to `out` and print their tables."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(output, indent=2) + "\n")
    console = Console(width=None if sys.stdout.isatty() else 190)
    results, memory, config = (
        output["cases"],
        output["accumulation_memory"],
        output["config"],
    )
    if results:
        console.print(cases_table(results, config))
    if memory:
        console.print(memory_table(memory))
    console.print(f"peak RSS {output['max_rss_mib']:.0f} MiB; results in {out}")


if __name__ == "__main__":
    sys.exit(main())
