"""The cost model's constants measured on the devices it plans for, once,
and cached: the matrix FLOP/s each device achieves in bfloat16 and float32,
its memory bandwidth, and, over several devices, an all-reduce's latency
and bandwidth.

Why measure: a vendor's peak is no program's pace. On a TPU v5e a bare
8192³ bfloat16 matrix multiply reaches ~167 of the data sheet's 197
TFLOP/s (measured on the chip, JAX 0.10.2), a model's step far less; a
cost model of data-sheet figures predicted a 19 M-parameter transformer's
step 4-7x too fast there.

How: each figure is one jitted program run on every device at once (a
`jax.shard_map` over them: a device's pace with its neighbours busy, as in
a step, which on fake CPU devices sharing a host's cores is a share of
them), looping its work a traced number of times, ``n``, so it compiles
once. Its time per trip is the difference of the medians of a few runs at
two trip counts, after a warm-up run at each: the call's fixed cost
(dispatch, transfer of the result's handle) cancels. An all-reduce is
timed at two sizes, and a line through the two (``latency + bytes /
bandwidth``, bytes as a ring sends them, as `_hlo` counts a step's) gives
both. The sizes are large on an accelerator (8192² matrices, 256 MiB
arrays: compute- and bandwidth-bound, a few seconds in all) and small on a
CPU (under 2 s with 8 fake devices). One figure serves every mesh axis:
the devices of one host share their links.

The cache: one JSON file per (platform, device kind, device count, JAX and
jaxlib version) under ``$PHALANX_CACHE``, else ``$XDG_CACHE_HOME/phalanx``,
else ``~/.cache/phalanx``, in ``calibration/``; a JAX upgrade reads another
file, so measures again. Written whole or not at all (a temporary file
renamed over it); a damaged file is measured again and rewritten, with one
log line. This module measures and caches; `_devices` makes the figures a
`DeviceSpec`. Nothing here runs unless asked (see `_devices.device_spec`).
"""

import json
import math
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._log import logger


# Bumped when what is measured, or how, changes: older files are then read
# as another key's and measured again.
_FORMAT = 1
DTYPES = ("bfloat16", "float32")
_RUNS = 5


class Calibration(NamedTuple):
    """What one set of devices was measured to achieve, per device.

    Attributes:
        flops: matrix FLOP/s by compute dtype name (``"bfloat16"``,
            ``"float32"``).
        memory_bandwidth: bytes per second a device reads and writes.
        link_bandwidth: bytes per second a device sends in an all-reduce
            (None: one device, nothing to measure).
        link_latency: the seconds an all-reduce takes however small (None:
            one device).
        seconds: how long measuring took.
    """

    flops: dict[str, float]
    memory_bandwidth: float
    link_bandwidth: float | None
    link_latency: float | None
    seconds: float


def calibration_key(devices: Sequence[Any]) -> dict[str, Any]:
    """What a calibration of `devices` holds for: their platform, kind and
    count, and the JAX and jaxlib that compiled its programs."""
    first = devices[0]
    return {
        "platform": first.platform,
        "kind": first.device_kind,
        "devices": len(devices),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "format": _FORMAT,
    }


def cache_dir() -> Path:
    """phalanx's cache folder: ``$PHALANX_CACHE``, else ``phalanx`` under
    ``$XDG_CACHE_HOME``, else ``~/.cache/phalanx``."""
    if os.environ.get("PHALANX_CACHE"):
        return Path(os.environ["PHALANX_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "phalanx"


def cache_file(key: dict[str, Any]) -> Path:
    """The file of the calibration for `key` (one per key)."""
    name = "-".join(
        [key["platform"], key["kind"], f"x{key['devices']}"]
        + [f"jax{key['jax']}", f"jaxlib{key['jaxlib']}", f"v{key['format']}"]
    )
    return cache_dir() / "calibration" / (re.sub(r"[^\w.\-]+", "_", name) + ".json")


def calibrated(devices: Sequence[Any], *, cache: bool = True) -> Calibration:
    """The calibration of `devices`: the cached one where there is one
    (with `cache`), else measured now (`measure_devices`) and cached."""
    key = calibration_key(devices)
    path = cache_file(key)
    if cache and path.exists():
        found = _load(path, key)
        if found is not None:
            return found
    measured = measure_devices(devices)
    logger.info(
        "measured the cost model's constants on %d %s device(s) in %.1f s: %s",
        len(devices),
        key["kind"],
        measured.seconds,
        describe(measured),
    )
    if cache:
        _save(path, key, measured)
    return measured


def describe(found: Calibration) -> str:
    """The figures in one line."""
    said = [
        f"{dtype} {flops / 1e12:.3g} TFLOP/s" for dtype, flops in found.flops.items()
    ]
    said.append(f"memory {found.memory_bandwidth / 1e9:.3g} GB/s")
    if found.link_bandwidth is not None and found.link_latency is not None:
        said.append(
            f"all-reduce {found.link_bandwidth / 1e9:.3g} GB/s after "
            f"{found.link_latency * 1e6:.3g} us"
        )
    return ", ".join(said)


def measure_devices(devices: Sequence[Any]) -> Calibration:
    """Measure `devices` now (see module); not cached."""
    began = time.perf_counter()
    mesh = Mesh(np.asarray(devices), ("d",))
    accelerator = devices[0].platform != "cpu"
    side = 8192 if accelerator else 128
    flops = {
        dtype: 2.0 * side**3 / _matmul(mesh, side, jnp.dtype(dtype)) for dtype in DTYPES
    }
    elements = (256 if accelerator else 2) * 2**20 // 4
    bandwidth = 2.0 * 4 * elements / _stream(mesh, elements)
    link = latency = None
    n = len(devices)
    if n > 1:
        sizes = (1024, 8 * 2**20 if accelerator else 64 * 1024)
        sent = [4.0 * size * 2 * (n - 1) / n for size in sizes]  # a ring all-reduce
        took = [_all_reduce(mesh, size) for size in sizes]
        link, latency = _line(sent, took)
    return Calibration(flops, bandwidth, link, latency, time.perf_counter() - began)


def _line(sent: list[float], took: list[float]) -> tuple[float, float]:
    """The bandwidth and latency of ``took = latency + sent / bandwidth``
    through two points; where noise makes it fall, the larger point's mean
    rate and the smaller one's time."""
    rise = took[1] - took[0]
    if rise <= 0:
        return sent[1] / took[1], took[0]
    bandwidth = (sent[1] - sent[0]) / rise
    return bandwidth, max(took[0] - sent[0] / bandwidth, 0.0)


def _matmul(mesh: Mesh, side: int, dtype: Any) -> float:
    """Seconds per ``side``³ matrix multiply, on each device at once."""

    def loop(a: jax.Array, b: jax.Array, n: jax.Array) -> jax.Array:
        # b holds 1/side: the product of ones by it is ones again, so the
        # values neither grow nor vanish, however many trips.
        return jax.lax.fori_loop(0, n, lambda _, c: c @ b, a)

    a = _filled(mesh, (side, side), dtype, 1.0)
    b = _filled(mesh, (side, side), dtype, 1.0 / side)
    return _per_trip(_per_device(loop, mesh, 2), (a, b), (1, 3))


def _stream(mesh: Mesh, elements: int) -> float:
    """Seconds to read and write `elements` float32s, on each device."""

    def loop(x: jax.Array, n: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, n, lambda _, y: y * 0.5 + 1.0, x)

    x = _filled(mesh, (elements,), jnp.dtype("float32"), 1.0)
    return _per_trip(_per_device(loop, mesh, 1), (x,), (2, 6))


def _all_reduce(mesh: Mesh, elements: int) -> float:
    """Seconds per all-reduce of `elements` float32s over the mesh."""
    share = 1.0 / mesh.size

    def loop(x: jax.Array, n: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, n, lambda _, y: jax.lax.psum(y, "d") * share, x)

    x = _filled(mesh, (elements,), jnp.dtype("float32"), 1.0)
    return _per_trip(_per_device(loop, mesh, 1), (x,), (2, 6))


def _per_device(fn: Callable[..., jax.Array], mesh: Mesh, arrays: int) -> Any:
    """`fn` jitted over the mesh: its `arrays` first arguments a block a
    device, its last (the trip count) the same on all."""
    specs = (P("d"),) * arrays + (P(),)
    # check_vma off: an all-reduce's result is the same on every device, and
    # the loop carries it back in as the device's own block.
    mapped = jax.shard_map(
        fn, mesh=mesh, in_specs=specs, out_specs=P("d"), check_vma=False
    )
    return jax.jit(mapped)


def _filled(mesh: Mesh, shape: tuple[int, ...], dtype: Any, value: float) -> jax.Array:
    """A block of `shape` filled with `value` on each device, made there."""
    whole = (mesh.size * shape[0], *shape[1:])
    make = jax.jit(
        lambda: jnp.full(whole, value, dtype), out_shardings=NamedSharding(mesh, P("d"))
    )
    return make()


def _per_trip(fn: Any, arrays: tuple[jax.Array, ...], counts: tuple[int, int]) -> float:
    """Seconds per trip of `fn`'s loop: the difference of the medians of
    `_RUNS` runs at the two trip `counts`, each after a warm-up run; where
    noise makes it no more than zero, the larger count's mean."""
    medians = []
    for count in counts:
        n = jnp.asarray(count, jnp.int32)
        jax.block_until_ready(fn(*arrays, n))
        runs = []
        for _ in range(_RUNS):
            began = time.perf_counter()
            jax.block_until_ready(fn(*arrays, n))
            runs.append(time.perf_counter() - began)
        medians.append(statistics.median(runs))
    per = (medians[1] - medians[0]) / (counts[1] - counts[0])
    return per if per > 0 else medians[1] / counts[1]


def _load(path: Path, key: dict[str, Any]) -> Calibration | None:
    """The calibration cached in `path` for `key`; None (with one log
    line) where the file is damaged or holds another key's."""
    try:
        held = json.loads(path.read_text())
        if held["key"] != key:
            raise ValueError("it holds another set of devices' figures")
        flops = {dtype: _positive(held["flops"][dtype]) for dtype in DTYPES}
        link, latency = held["link_bandwidth"], held["link_latency"]
        if (link is None) != (latency is None):
            raise ValueError("it holds half of the links' figures")
        return Calibration(
            flops,
            _positive(held["memory_bandwidth"]),
            None if link is None else _positive(link),
            None if latency is None else _positive(latency, zero=True),
            float(held["seconds"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning(
            "the cost model's calibration %s is unreadable (%s); measuring the "
            "devices again",
            path,
            error,
        )
        return None


def _positive(value: Any, *, zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r} is not a number")
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise ValueError(f"{value!r} is not a positive number")
    return float(value)


def _save(path: Path, key: dict[str, Any], found: Calibration) -> None:
    """Write `found` to `path` whole (a temporary file beside it, renamed
    over it: a reader sees the old file or the new one, never part of one);
    where the folder cannot be written, one log line and no cache."""
    held = {"key": key, **found._asdict()}
    written = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False
        ) as file:
            written = file.name
            json.dump(held, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        os.replace(written, path)
    except OSError as error:
        if written is not None and os.path.exists(written):
            os.unlink(written)
        logger.warning(
            "could not cache the cost model's calibration in %s (%s); the next "
            "plan measures again",
            path.parent,
            error,
        )
