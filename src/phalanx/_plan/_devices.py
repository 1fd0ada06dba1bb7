"""What the planner's cost model assumes of a device: its peak dense
matrix throughput, its memory bandwidth and its link bandwidth to the
other devices of its slice or node (datasheet figures, per chip), and how
many bytes a step may take on it (`budget_bytes`).

The figures are the vendors' published peaks (bfloat16 dense, no
sparsity; memory: HBM; link: one direction of NVLink per GPU, the ICI of
one chip per TPU). No program reaches them; the cost model ranks layouts
by them (the guide "Planning a fit" says how far off it is measured).
"""

import dataclasses
import re
from typing import Any


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One kind of device, as the cost model sees it.

    Attributes:
        name: the kind (``"H100"``, ``"TPU v5p"``, ``"cpu"``).
        flops: peak dense matrix operations per second (bfloat16).
        memory_bandwidth: bytes per second between the chip and its memory.
        link_bandwidth: bytes per second a device sends to the others (one
            direction).
        relative: the figures are nominal, for ranking layouts against one
            another only (a CPU: its fake devices share one host's cores).
    """

    name: str
    flops: float
    memory_bandwidth: float
    link_bandwidth: float
    relative: bool = False


DEVICES = {
    spec.name.lower(): spec
    for spec in (
        DeviceSpec("H100", 989e12, 3.35e12, 450e9),
        DeviceSpec("H200", 989e12, 4.8e12, 450e9),
        DeviceSpec("A100", 312e12, 2.04e12, 300e9),
        DeviceSpec("TPU v4", 275e12, 1.23e12, 300e9),
        DeviceSpec("TPU v5e", 197e12, 0.82e12, 200e9),
        DeviceSpec("TPU v5p", 459e12, 2.76e12, 600e9),
        # Nominal: a ranking on a CPU host says which layout does less, not
        # how long it takes.
        DeviceSpec("cpu", 1e11, 2e10, 1e10, relative=True),
    )
}


def device_spec(device: str | DeviceSpec | None, kind: str) -> DeviceSpec:
    """The spec named by `device` (a key of `DEVICES`, any case), or, with
    None, that of the devices' `kind` (``jax.Device.device_kind``; a kind
    not in the table is costed as a CPU is: relatively).

    Raises:
        ValueError: `device` names no device of the table.
    """
    if isinstance(device, DeviceSpec):
        return device
    if device is not None:
        found = DEVICES.get(device.lower())
        if found is None:
            raise ValueError(
                f"device={device!r} is not a device the cost model knows; pass one "
                f"of {sorted(spec.name for spec in DEVICES.values())}, or a "
                "px.DeviceSpec(name, flops, memory_bandwidth, link_bandwidth)"
            )
        return found
    for spec in DEVICES.values():
        if spec.name != "cpu" and re.search(rf"\b{re.escape(spec.name)}\b", kind, re.I):
            return spec
    return DEVICES["cpu"]


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


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
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        unit = None if match is None else _UNITS.get(match.group(2).lower())
        if match is None or unit is None:
            raise ValueError(
                f"budget={budget!r} is not a size; pass bytes as an int or a "
                "string such as '16GiB', '512MiB' or '2.5GB'"
            )
        budget = int(float(match.group(1)) * unit)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(
            f"budget={budget!r} must be a positive number of bytes per device "
            "(an int, or a string such as '16GiB')"
        )
    return budget
