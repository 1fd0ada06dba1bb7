"""What the planner's cost model assumes of a device: its peak dense
matrix throughput, its memory bandwidth and its link bandwidth to the
other devices of its slice or node (datasheet figures, per chip), and how
many bytes a step may take on it (`budget_bytes`).

The figures are the vendors' published peaks (dense, no sparsity, in the
step's compute dtype: the MFU table's; memory: HBM; link: one direction of
NVLink per GPU, the ICI of one chip per TPU). No program reaches them;
the cost model ranks layouts by them (the guide "Planning a fit" says how
far off it is measured).
"""

import dataclasses
import re
from typing import Any

import numpy as np

from .._telemetry._peak_flops import peak_flops
from .._typing import validates_own_arguments
from ._sizes import HOW, parse_size


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
    """

    name: str
    flops: float
    memory_bandwidth: float
    link_bandwidth: float
    host_bandwidth: float = 32e9
    relative: bool = False


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
    device: str | DeviceSpec | None, kind: str, compute: np.dtype
) -> DeviceSpec:
    """The spec of `device` (a name of the tables, e.g. ``"h100"``, found
    as whole words: ``"NVIDIA H100 80GB HBM3"`` is one, ``"h1000"`` none; a
    `DeviceSpec`; None: the devices' own `kind`, their
    ``jax.Device.device_kind``), its peak in the `compute` dtype (the
    MFU table's, `_telemetry/_peak_flops.py`). A kind of neither table is
    costed as a CPU is: relatively.

    Raises:
        TypeError: `device` is neither a name, a `DeviceSpec` nor None.
        ValueError: `device` names no device of the tables.
    """
    if isinstance(device, DeviceSpec):
        return device
    if device is not None and not isinstance(device, str):
        raise TypeError(
            f"device={device!r}: pass a device name such as 'h100' or "
            "'tpu v5e', a px.DeviceSpec, or None for the devices' own kind"
        )
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
