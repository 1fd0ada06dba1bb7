"""What the planner's cost model assumes of a device: the matrix FLOP/s
it achieves, its memory bandwidth and its link bandwidth (and latency) to
the other devices of its slice or node, and how many bytes a step may take
on it (`budget_bytes`).

Where the figures come from (`device_spec`):

- **Measured** (`calibrate`, `_calibration.py`): on an accelerator, a plan
  for the devices' own kind measures them once per (platform, kind, device
  count, JAX version) and caches the figures, a few seconds the first time.
  On a CPU host a plan does not (its fake devices share the host's cores;
  its figures rank layouts, they do not predict) unless asked:
  ``device=px.calibrate()``.
- **Data sheets**: a device named by the user (``device="h100"``), with the
  vendors' published peaks (dense, no sparsity, in the step's compute
  dtype: the MFU table's; memory: HBM; link: one direction of NVLink per
  GPU, the ICI of one chip per TPU). No program reaches them.
- **The user's own** `DeviceSpec`: an injected cost table, used as given.
"""

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._telemetry._peak_flops import peak_flops
from .._typing import validates_own_arguments
from ._calibration import Calibration, calibrated
from ._sizes import HOW, parse_size


def _number(value: Any) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
    )


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One kind of device, as the cost model sees it.

    Attributes:
        name: the kind (``"H100"``, ``"TPU v5p"``, ``"cpu"``).
        flops: peak dense matrix operations per second, in the step's
            compute dtype.
        memory_bandwidth: bytes per second between the chip and its memory.
        link_bandwidth: bytes per second a device sends to the others (one
            direction).
        host_bandwidth: bytes per second between a device and host memory
            (one direction): what offloaded optimizer state crosses.
        relative: the figures are nominal, for ranking layouts against one
            another only (a CPU: its fake devices share one host's cores).
        link_latency: the seconds a collective takes however few its bytes
            (each collective of a step pays it once).
        calibrated: the figures were measured on the devices (`calibrate`),
            not read from a data sheet or given.
        flops_by_dtype: the matrix FLOP/s by compute dtype name
            (``"bfloat16"``, ``"float32"``), where known: a plan takes its
            step's (`in_dtype`), and `flops` is then that one.

    Example:
        ```python
        # Links ten times slower than an H100's NVLink: a plan then weighs
        # its collectives ten times as dear.
        slow = px.DeviceSpec("h100, slow links", 495e12, 3.35e12, 45e9)
        shapes = (jax.ShapeDtypeStruct((256, 64), jax.numpy.float32),
                  jax.ShapeDtypeStruct((256,), jax.numpy.int32))
        plan = px.plan(lambda: px.models.MLP(64, 10, key=jax.random.key(0)),
                       optax.adam(1e-3), shapes, budget="16MiB", device=slow)
        ```
    """

    name: str
    flops: float
    memory_bandwidth: float
    link_bandwidth: float
    host_bandwidth: float = 32e9
    relative: bool = False
    link_latency: float = 0.0
    calibrated: bool = False
    flops_by_dtype: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        rates = dict(self.flops_by_dtype)
        rates.update(
            flops=self.flops,
            memory_bandwidth=self.memory_bandwidth,
            link_bandwidth=self.link_bandwidth,
            host_bandwidth=self.host_bandwidth,
        )
        for field, value in rates.items():
            if not _number(value) or not value > 0:
                raise ValueError(
                    f"DeviceSpec {field}={value!r} must be a positive number (per "
                    "second), e.g. flops=495e12 or memory_bandwidth=3.35e12"
                )
        if not _number(self.link_latency) or not self.link_latency >= 0:
            raise ValueError(
                f"DeviceSpec link_latency={self.link_latency!r} must be a number of "
                "seconds >= 0, e.g. 1e-5"
            )

    def in_dtype(self, compute: np.dtype) -> "DeviceSpec":
        """This spec with `flops` in the `compute` dtype, where
        `flops_by_dtype` has it (float16 as bfloat16: the same matrix units);
        as it is otherwise."""
        rates = dict(self.flops_by_dtype)
        name = "bfloat16" if compute == jnp.float16 else np.dtype(compute).name
        if name not in rates:
            return self
        return dataclasses.replace(self, flops=rates[name])


# (the names device_kind may contain, case folded; memory bytes/s; link
# bytes/s one direction; host bytes/s one direction), the more specific names
# first. A TPU from v5 on goes by two names: JAX's device_kind ("TPU v5 lite",
# "TPU v5") and Google's ("TPU v5e", "TPU v5p").
# Sources: the vendors' data sheets (HBM bandwidth; NVLink per GPU, half the
# bidirectional figure; PCIe 5 x16 for the PCIe H100; a TPU chip's ICI;
# host: the PCIe generation's x16 link, 4 for A100 and TPU v4, 5 after).
_KINDS: tuple[tuple[tuple[str, ...], float, float, float], ...] = (
    (("a100",), 2.04e12, 300e9, 32e9),
    (("h100 pcie",), 2.0e12, 64e9, 64e9),
    (("h100",), 3.35e12, 450e9, 64e9),
    (("h200",), 4.8e12, 450e9, 64e9),
    (("b200",), 8.0e12, 900e9, 64e9),
    (("tpu v4",), 1.23e12, 300e9, 32e9),
    (("tpu v5 lite", "tpu v5e"), 0.82e12, 200e9, 32e9),
    (("tpu v5p", "tpu v5"), 2.76e12, 600e9, 64e9),
    (("tpu v6 lite", "tpu v6e"), 1.64e12, 448e9, 64e9),
)
# One row a name, in that order: (name; memory; link; host).
BANDWIDTHS: tuple[tuple[str, float, float, float], ...] = tuple(
    (name, memory, link, host) for names, memory, link, host in _KINDS for name in names
)
# Nominal: a ranking on a CPU host says which layout does less, not how long
# it takes.
CPU = DeviceSpec("cpu", 1e11, 2e10, 1e10, 1e10, relative=True)


@validates_own_arguments
def device_spec(
    device: str | DeviceSpec | None,
    kind: str,
    compute: np.dtype,
    devices: Sequence[Any] | None = None,
) -> DeviceSpec:
    """The spec a plan in the `compute` dtype prices:

    - `device` a `DeviceSpec`: it, in the `compute` dtype where it says
      its FLOP/s by dtype (`DeviceSpec.in_dtype`);
    - None, with the `devices` planned for on an accelerator: their figures
      measured (once per platform, kind, count and JAX version, then read
      from the cache; see `calibrate`);
    - a name of the tables (e.g. ``"h100"``, found as whole words:
      ``"NVIDIA H100 80GB HBM3"`` is one, ``"h1000"`` none), or None (with
      no accelerator `devices`): the data sheet's figures for it, or for
      the devices' own `kind` (their ``jax.Device.device_kind``), its peak
      the MFU table's (`_telemetry/_peak_flops.py`). A kind of neither
      table is costed as a CPU is: relatively.

    Raises:
        TypeError: `device` is neither a name, a `DeviceSpec` nor None.
        ValueError: `device` names no device of the tables.
    """
    if isinstance(device, DeviceSpec):
        return device.in_dtype(compute)
    if device is not None and not isinstance(device, str):
        raise TypeError(
            f"device={device!r}: pass a device name such as 'h100' or "
            "'tpu v5e', a px.DeviceSpec, or None for the devices' own kind"
        )
    if device is None and devices and devices[0].platform != "cpu":
        return _measured(calibrated(list(devices)), kind).in_dtype(compute)
    name = (device if device is not None else kind).casefold()
    for known, memory, link, host in BANDWIDTHS:
        peak = peak_flops(known, compute)
        if _names(known, name, whole=device is not None) and peak is not None:
            return DeviceSpec(known.upper(), peak, memory, link, host)
    if device is not None and device.casefold() != "cpu":
        raise ValueError(
            f"device={device!r} is not a device the cost model knows; pass one of "
            f"{[entry[0] for entry in BANDWIDTHS]} or 'cpu', or a "
            "px.DeviceSpec(name, flops, memory_bandwidth, link_bandwidth)"
        )
    return CPU


@validates_own_arguments
def calibrate(
    devices: int | Sequence[Any] | None = None, *, cache: bool = True
) -> DeviceSpec:
    """The cost model's figures measured on `devices`: the matrix FLOP/s a
    device achieves in bfloat16 and float32, its memory bandwidth and,
    over several devices, an all-reduce's bandwidth and latency (a few
    seconds on an accelerator, under two on a CPU host).

    Measured once per platform, device kind, device count and JAX and
    jaxlib version, and cached under ``$PHALANX_CACHE`` (else
    ``$XDG_CACHE_HOME/phalanx``, else ``~/.cache/phalanx``): a JAX upgrade
    measures again. A plan on an accelerator calibrates by itself; on a
    CPU host, where its fake devices share the host's cores, it ranks
    layouts by nominal figures unless given this. The host link and, on
    one device, the links between devices are the data sheet's (or a
    CPU's nominal ones): nothing is measured there.

    Args:
        devices: the devices to measure: a count of `jax.local_devices()`,
            a list of local devices, or None for all of them.
        cache: read and write the cache (False: measure now, keep nothing).

    Returns:
        A `DeviceSpec` with ``calibrated=True``, its FLOP/s by dtype (a plan
        takes its step's).

    Raises:
        TypeError, ValueError: `devices` is not a count, a list of this
            process' devices, or None.

    Example:
        ```python
        shapes = (jax.ShapeDtypeStruct((256, 64), jax.numpy.float32),
                  jax.ShapeDtypeStruct((256,), jax.numpy.int32))
        plan = px.plan(lambda: px.models.MLP(64, 10, key=jax.random.key(0)),
                       optax.adam(1e-3), shapes, budget="16MiB",
                       device=px.calibrate())
        ```
    """
    local = jax.local_devices()
    fix = f"pass a count from 1 to {len(local)}, a list of jax.local_devices(), or None"
    if not isinstance(cache, bool):
        raise TypeError(f"cache={cache!r} must be True or False")
    if devices is None:
        chosen = local
    elif isinstance(devices, bool) or not isinstance(devices, int | Sequence):
        raise TypeError(f"devices={devices!r}: {fix}")
    elif isinstance(devices, int):
        if not 1 <= devices <= len(local):
            raise ValueError(
                f"devices={devices!r}: this process has {len(local)}; {fix}"
            )
        chosen = local[:devices]
    else:
        chosen = list(devices)
        if not chosen or not all(d in local for d in chosen):
            raise ValueError(
                f"devices={devices!r} are not this process' devices; {fix}"
            )
    return _measured(calibrated(chosen, cache=cache), chosen[0].device_kind)


def _measured(found: Calibration, kind: str) -> DeviceSpec:
    """The spec of devices of `kind` measured as `found` (float32's FLOP/s
    until a plan takes its dtype's; the host link, and the device links
    where one device measured none, from the data sheet or nominal)."""
    table = next(
        (row for row in BANDWIDTHS if _names(row[0], kind.casefold(), whole=False)),
        None,
    )
    link, host = (
        (table[2], table[3]) if table else (CPU.link_bandwidth, CPU.host_bandwidth)
    )
    return DeviceSpec(
        kind,
        found.flops["float32"],
        found.memory_bandwidth,
        found.link_bandwidth or link,
        host,
        link_latency=found.link_latency or 0.0,
        calibrated=True,
        flops_by_dtype=tuple(sorted(found.flops.items())),
    )


def _names(known: str, name: str, *, whole: bool) -> bool:
    """Whether `name` names the table's `known` kind: contains it (a
    ``device_kind`` such as ``"NVIDIA H100 80GB HBM3"``), as whole words
    where the user gave it (``"h1000"`` is no H100)."""
    if not whole:
        return known in name
    return re.search(rf"(?<![a-z0-9]){re.escape(known)}(?![a-z0-9])", name) is not None


def budget_bytes(budget: int | str | None, devices: list[Any]) -> int:
    """The bytes a step may take on each device: `budget` (an int of
    bytes, or a string such as ``"16GiB"`` or ``"500 MB"``), or, with
    None, the first device's memory where JAX reports it.

    Raises:
        ValueError: `budget` is not a positive size, or None where the
            devices report no memory (a CPU).
    """
    if budget is None:
        stats = (
            devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
        )
        limit = (stats or {}).get("bytes_limit")
        if not limit:
            raise ValueError(
                f"budget=None, and the {devices[0].platform} devices report no "
                "memory limit to JAX; pass the bytes a step may take on each "
                "device, e.g. budget='16GiB' (or budget=16 * 2**30)"
            )
        return int(limit)
    if isinstance(budget, str):
        try:
            return parse_size(budget)
        except ValueError as error:
            raise ValueError(f"budget={error}") from None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(
            f"budget={budget!r} must be a positive number of bytes per device: {HOW}"
        )
    return budget
