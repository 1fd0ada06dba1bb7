"""Placement lives in `strategies/` (and `data/`, which hands NumPy on): no
other module calls `jax.device_put`; the placement functions do what the
callers elsewhere did."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import phalanx as px
from phalanx.strategies._placement import (
    on_device,
    put_replicated,
    replicated_copies,
    replicated_float32,
)


SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"
PLACING = ("strategies", "data")


def device_puts(root: Path) -> list[str]:
    """The modules under `root` (relative paths) that call `jax.device_put`."""
    return sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if re.search(r"\bdevice_put\(", path.read_text())
        and path.relative_to(root).parts[0] not in PLACING
    )


def test_only_strategies_and_data_place_arrays():
    assert device_puts(SRC) == []


def test_the_check_finds_a_device_put(tmp_path):
    (tmp_path / "strategies").mkdir()
    (tmp_path / "strategies" / "ok.py").write_text("jax.device_put(x, s)\n")
    (tmp_path / "bad.py").write_text("y = jax.device_put(x, s)\n")
    assert device_puts(tmp_path) == ["bad.py"]


def test_placement_functions():
    mesh = px.ShardingStrategy(8).mesh
    zeros, flags = put_replicated((np.zeros(3, np.float32), np.zeros(2)), mesh)
    assert zeros.sharding.spec == P() and zeros.sharding.mesh == mesh
    assert flags.sharding.is_fully_replicated and len(flags.sharding.device_set) == 8
    total = replicated_float32(2.5, mesh)
    totals = replicated_float32([1.0, 2.0], mesh)
    assert total.dtype == jnp.float32 and float(total) == 2.5
    assert totals.shape == (2,) and totals.sharding.is_fully_replicated
    # Copies: donating them leaves the originals alive.
    original = jax.device_put(jnp.arange(4.0), zeros.sharding)
    (copy,) = replicated_copies([original], mesh)
    jax.jit(lambda x: x + 1, donate_argnums=0)(copy)
    assert copy.is_deleted() and not original.is_deleted()
    device = jax.devices()[3]
    moved = on_device({"a": original, "b": np.ones(2)}, device)
    assert moved["a"].devices() == moved["b"].devices() == {device}
