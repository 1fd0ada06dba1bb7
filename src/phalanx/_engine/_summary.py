"""A model's parameters and the training state's memory, per device."""

import dataclasses
import io
import math
from typing import Any

import equinox as eqx
import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from .._state._train_state import TrainState
from ..strategies import AccumulatingStrategy, Strategy
from ._layout import StateLayout


@dataclasses.dataclass(frozen=True)
class ParameterRow:
    """One parameter array of the model.

    Attributes:
        path: where it is in the model, e.g. ``layers[0].weight``.
        shape: its (global) shape.
        dtype: its dtype.
        size: its elements.
        nbytes: its bytes, whole.
        nbytes_per_device: the bytes each device holds of it under the
            strategy (all of them where it is replicated).
    """

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    size: int
    nbytes: int
    nbytes_per_device: int


@dataclasses.dataclass(frozen=True)
class ModelSummary:
    """The model's parameters, one row per array, and the memory the
    training state takes on each device.

    Print it with rich for a table (``rich.print(summary)``), or as text
    (``print(summary)``); `short` is one line. Bytes are those of the arrays
    at rest, between steps: a step also holds activations, gradients and,
    under `FullyShardedStrategy`, the gathered parameters.

    Attributes:
        model: the model's class name.
        strategy: the strategy's class name (with the strategy an
            `AccumulatingStrategy` wraps).
        num_devices: the devices a step runs on.
        rows: one per floating-point array of the model, in tree order.
        total_params: elements of all the rows.
        param_bytes, param_bytes_per_device: the rows' bytes, whole and on
            each device.
        opt_state_bytes, opt_state_bytes_per_device: the optimizer state's.
        model_state_bytes, model_state_bytes_per_device: the model state's
            (`eqx.nn.State`: BatchNorm averages); 0 without one.
        state_bytes, state_bytes_per_device: the whole `TrainState`'s (step,
            key, model with any non-floating arrays, optimizer and model
            state, loss scale).
    """

    model: str
    strategy: str
    num_devices: int
    rows: tuple[ParameterRow, ...]
    total_params: int
    param_bytes: int
    param_bytes_per_device: int
    opt_state_bytes: int
    opt_state_bytes_per_device: int
    model_state_bytes: int
    model_state_bytes_per_device: int
    state_bytes: int
    state_bytes_per_device: int

    def short(self) -> str:
        """The summary in one line: parameters, memory per device, strategy."""
        parts = [
            f"{self.model}: {self.total_params:,} parameters "
            f"({format_bytes(self.param_bytes)}; "
            f"{format_bytes(self.param_bytes_per_device)} per device)",
            f"optimizer state {format_bytes(self.opt_state_bytes_per_device)} "
            "per device",
        ]
        if self.model_state_bytes:
            parts.append(
                f"model state {format_bytes(self.model_state_bytes_per_device)} "
                "per device"
            )
        parts.append(f"{self.strategy} on {self._devices()}")
        return ", ".join(parts)

    def _devices(self) -> str:
        return f"{self.num_devices} device{'s' if self.num_devices != 1 else ''}"

    def __rich__(self) -> Table:
        """A rich table: a row per parameter array, the totals at its foot
        and the rest of the state in its caption."""
        parts = [
            ("optimizer state", self.opt_state_bytes, self.opt_state_bytes_per_device),
            ("model state", self.model_state_bytes, self.model_state_bytes_per_device),
            ("whole TrainState", self.state_bytes, self.state_bytes_per_device),
        ]
        caption = "\n".join(
            f"{name} {format_bytes(whole)} ({format_bytes(here)} per device)"
            for name, whole, here in parts
            if whole or name != "model state"
        )
        table = Table(
            title=f"{self.model} under {self.strategy} on {self._devices()}",
            caption=caption,
            caption_justify="left",
            show_footer=True,
        )
        table.add_column("Parameter", footer="Total")
        table.add_column("Shape")
        table.add_column("Dtype")
        table.add_column("Size", f"{self.total_params:,}", justify="right")
        table.add_column("Bytes", format_bytes(self.param_bytes), justify="right")
        table.add_column(
            "Per device", format_bytes(self.param_bytes_per_device), justify="right"
        )
        for row in self.rows:
            table.add_row(
                row.path,
                str(list(row.shape)),
                str(row.dtype),
                f"{row.size:,}",
                format_bytes(row.nbytes),
                format_bytes(row.nbytes_per_device),
            )
        return table

    def __str__(self) -> str:
        """The table as plain text (no colours), as wide as it needs."""
        table = self.__rich__()
        # Measured, not the terminal's width: a narrow one must not fold rows.
        width = Console(file=io.StringIO(), width=1 << 12).measure(table).maximum
        text = io.StringIO()
        Console(file=text, width=width, color_system=None).print(table)
        return "\n".join(line.rstrip() for line in text.getvalue().splitlines())


def format_bytes(n: int) -> str:
    """`n` bytes in binary units: ``"512 B"``, ``"168.5 KiB"``, ``"1.2 GiB"``."""
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    power = 0
    # The unit in which the rounded value is below 1024 (1048575 B is 1.0 MiB).
    while power < len(units) - 1 and round(n / 1024**power, 1) >= 1024:
        power += 1
    if power == 0:
        return f"{n} B"
    return f"{n / 1024**power:.1f} {units[power]}"


def summarize(
    layout: StateLayout, state: TrainState, strategy: Strategy
) -> ModelSummary:
    """The summary of `state`, laid out on devices as `layout` says.

    Args:
        layout: the state's layout (its shardings), for `strategy`.
        state: the training state (its arrays are not read, only their
            shapes and dtypes).
        strategy: the strategy the layout is of.
    """
    dynamic = eqx.filter(state, eqx.is_array)
    leaves = jax.tree_util.tree_flatten_with_path(dynamic)[0]
    whole: dict[str, int] = {}
    per_device: dict[str, int] = {}
    rows = []
    for (path, leaf), sharding, struct in zip(
        leaves, layout.shardings, layout.structs, strict=True
    ):
        # Sizes as the array travels (a PRNG key as its raw data).
        itemsize = np.dtype(struct.dtype).itemsize
        size, shard = math.prod(struct.shape), sharding.shard_shape(struct.shape)
        nbytes, nbytes_here = size * itemsize, math.prod(shard) * itemsize
        field = _field(path)
        whole[field] = whole.get(field, 0) + nbytes
        per_device[field] = per_device.get(field, 0) + nbytes_here
        if field == "model" and eqx.is_inexact_array(leaf):
            rows.append(
                ParameterRow(
                    jax.tree_util.keystr(path[1:]).removeprefix("."),
                    tuple(leaf.shape),
                    np.dtype(leaf.dtype),
                    size,
                    nbytes,
                    nbytes_here,
                )
            )
    return ModelSummary(
        model=type(state.model).__name__,
        strategy=strategy_name(strategy),
        num_devices=strategy.num_devices,
        rows=tuple(rows),
        total_params=sum(row.size for row in rows),
        param_bytes=sum(row.nbytes for row in rows),
        param_bytes_per_device=sum(row.nbytes_per_device for row in rows),
        opt_state_bytes=whole.get("opt_state", 0),
        opt_state_bytes_per_device=per_device.get("opt_state", 0),
        model_state_bytes=whole.get("model_state", 0),
        model_state_bytes_per_device=per_device.get("model_state", 0),
        state_bytes=sum(whole.values()),
        state_bytes_per_device=sum(per_device.values()),
    )


def _field(path: tuple[Any, ...]) -> str:
    """The `TrainState` field a leaf's path starts at (``"model"``, ...)."""
    return getattr(path[0], "name", "")


def strategy_name(strategy: Strategy) -> str:
    """The strategy's class, with what a wrapper wraps:
    ``AccumulatingStrategy(PmapStrategy, microbatches=4)``."""
    name = type(strategy).__name__
    if isinstance(strategy, AccumulatingStrategy):
        inner = strategy_name(strategy.inner)
        return f"{name}({inner}, microbatches={strategy.microbatches})"
    return name
