"""A model's parameters and the training state's memory, per device: the
`ModelSummary` that `trainer.summary()` returns, read from the state's
layout (its shapes and shardings), never from the arrays' values; and,
given a batch, the compiled train step's memory (`StepMemory`); and the
step's FLOPs where a batch is known (`StepFlops`, counted by the caller)."""

import dataclasses
import io
import math
from typing import Any

import equinox as eqx
import jax
import numpy as np
from rich.console import Console
from rich.table import Table

from ..._state._train_state import TrainState
from ..._telemetry._flops import StepFlops
from ...strategies import Strategy
from ...strategies._names import strategy_name
from ...strategies._placement import HOST_MEMORY
from ..step._layout import StateLayout


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
class StepMemory:
    """What the compiled train step takes on each device, as XLA plans it
    (`jax.stages.Compiled.memory_analysis`).

    Attributes:
        arguments: the bytes of its inputs (the state and the batch).
        outputs: the bytes of its outputs (the new state, the step's sums).
        aliased: the outputs' bytes that reuse their inputs' buffers (the
            state, donated).
        temporaries: the bytes it allocates while it runs: activations,
            gradients and, where the parameters are split, the gathered ones.
        code: the bytes of its compiled code where the device holds them
            (an accelerator's: XLA:TPU loads a program into the device's
            memory, 67 MB for the tests' 19 M transformer's step on a v5e);
            0 where the host does (a CPU), or where not asked.
    """

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    code: int = 0

    @property
    def peak(self) -> int:
        """The most a step holds at once on a device: inputs, temporaries,
        the outputs that do not reuse an input's buffer and its code (an
        upper bound: XLA may free an input before the last temporary is
        made)."""
        held = self.arguments + self.outputs - self.aliased
        return held + self.temporaries + self.code

    @classmethod
    def of(cls, compiled: jax.stages.Compiled) -> "StepMemory | None":
        """The memory of `compiled`; None where the backend does not say."""
        return cls.of_stats(compiled.memory_analysis())

    @classmethod
    def of_stats(cls, stats: Any, *, code: bool = False) -> "StepMemory | None":
        """The memory a compiled step's `memory_analysis()` says (None where
        the backend does not say), its `code` counted if asked."""
        if stats is None:
            return None
        return cls(
            arguments=int(stats.argument_size_in_bytes),
            outputs=int(stats.output_size_in_bytes),
            aliased=int(stats.alias_size_in_bytes),
            temporaries=int(stats.temp_size_in_bytes),
            code=int(stats.generated_code_size_in_bytes) if code else 0,
        )


@dataclasses.dataclass(frozen=True)
class ModelSummary:
    """The model's parameters, one row per array, and the memory the
    training state takes on each device.

    Print it with rich for a table (``rich.print(summary)``), or as text
    (``print(summary)``); `short` is one line. Bytes are those of the arrays
    at rest, between steps: a step also holds activations, gradients and,
    under `FullyShardedStrategy`, the gathered parameters. `step` says how
    much, where the summary was asked for a batch.

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
        step: the compiled train step's memory per device, for the batch
            ``trainer.summary(batch)`` was given; None without one.
        flops: the train step's FLOPs, for that batch or the first batch
            the trainer saw; None before any.
        warnings: the layout lint's lines: a large leaf left whole under a
            split layout, a dimension split unevenly (each with its fix).
        opt_state_on_host: the optimizer state is kept in host memory
            (`MeshStrategy(offload=True)`): its bytes per device are the
            host's, not the device's.
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
    step: StepMemory | None = None
    flops: StepFlops | None = None
    warnings: tuple[str, ...] = ()
    opt_state_on_host: bool = False

    def short(self) -> str:
        """The summary in one line: parameters, memory per device, FLOPs
        per step where known, strategy."""
        parts = [
            f"{self.model}: {self.total_params:,} parameters "
            f"({format_bytes(self.param_bytes)}; "
            f"{format_bytes(self.param_bytes_per_device)} per device)",
            f"optimizer state {format_bytes(self.opt_state_bytes_per_device)} "
            f"per device{' in host memory' if self.opt_state_on_host else ''}",
        ]
        if self.model_state_bytes:
            parts.append(
                f"model state {format_bytes(self.model_state_bytes_per_device)} "
                "per device"
            )
        if self.step is not None:
            parts.append(f"step peak {format_bytes(self.step.peak)} per device")
        if self.flops is not None:
            parts.append(self.flops.short())
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
        if self.step is not None:
            caption += (
                f"\ntrain step: peak {format_bytes(self.step.peak)} per device "
                f"(temporaries {format_bytes(self.step.temporaries)})"
            )
        if self.flops is not None:
            caption += f"\ntrain step: {self.flops.short()}"
        caption += "".join(f"\nlayout: {warning}" for warning in self.warnings)
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
        return plain_text(self.__rich__())


def plain_text(table: Table) -> str:
    """`table` as plain text (no colours), as wide as it needs."""
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
    layout: StateLayout,
    state: TrainState,
    strategy: Strategy,
    step: StepMemory | None = None,
    *,
    flops: StepFlops | None = None,
    warnings: tuple[str, ...] = (),
) -> ModelSummary:
    """The summary of `state`, laid out on devices as `layout` says.

    Args:
        layout: the state's layout (its shardings), for `strategy`.
        state: the training state (its arrays are not read, only their
            shapes and dtypes).
        strategy: the strategy the layout is of.
        step: the compiled train step's memory, where known.
        flops: the train step's FLOPs, where known.
        warnings: the layout lint's (`_lint.layout_warnings`).
    """
    # The layout as two `TrainState`s (of shardings, of shapes as the arrays
    # travel), so each part of the state is read by its field.
    shardings = jax.tree.unflatten(layout.treedef, layout.shardings)
    structs = jax.tree.unflatten(layout.treedef, layout.structs)
    model = jax.tree_util.tree_flatten_with_path(eqx.filter(state.model, eqx.is_array))
    rows = []
    for (path, leaf), sharding, struct in zip(
        model[0],
        jax.tree.leaves(shardings.model),
        jax.tree.leaves(structs.model),
        strict=True,
    ):
        if eqx.is_inexact_array(leaf):
            nbytes, nbytes_here = _bytes([sharding], [struct])
            rows.append(
                ParameterRow(
                    jax.tree_util.keystr(path).removeprefix("."),
                    tuple(leaf.shape),
                    np.dtype(leaf.dtype),
                    math.prod(struct.shape),
                    nbytes,
                    nbytes_here,
                )
            )
    opt_state = _bytes(shardings.opt_state, structs.opt_state)
    model_state = _bytes(shardings.model_state, structs.model_state)
    everything = _bytes(shardings, structs)
    return ModelSummary(
        model=type(state.model).__name__,
        strategy=strategy_name(strategy),
        num_devices=strategy.num_devices,
        rows=tuple(rows),
        total_params=sum(row.size for row in rows),
        param_bytes=sum(row.nbytes for row in rows),
        param_bytes_per_device=sum(row.nbytes_per_device for row in rows),
        opt_state_bytes=opt_state[0],
        opt_state_bytes_per_device=opt_state[1],
        model_state_bytes=model_state[0],
        model_state_bytes_per_device=model_state[1],
        state_bytes=everything[0],
        state_bytes_per_device=everything[1],
        step=step,
        flops=flops,
        warnings=warnings,
        opt_state_on_host=any(
            getattr(s, "memory_kind", None) == HOST_MEMORY
            for s in jax.tree.leaves(shardings.opt_state)
        ),
    )


def _bytes(shardings: Any, structs: Any) -> tuple[int, int]:
    """The bytes of the arrays `structs` describes (a PRNG key as its raw
    data, as it travels), whole and on each device as `shardings` lay them
    out."""
    whole = here = 0
    for sharding, struct in zip(
        jax.tree.leaves(shardings), jax.tree.leaves(structs), strict=True
    ):
        itemsize = np.dtype(struct.dtype).itemsize
        whole += math.prod(struct.shape) * itemsize
        here += math.prod(sharding.shard_shape(struct.shape)) * itemsize
    return whole, here
