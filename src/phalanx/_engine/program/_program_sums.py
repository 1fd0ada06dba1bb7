"""The entries of a program's packed sums, named on the host: a train
step's (`sum_layout`, `step_layout`) and an evaluation's (`eval_layout`)."""

import functools as ft
from typing import Any

import jax

from ..._state._sums import SumLayout, sum_order
from ...metrics._statistic import Summed
from ..step._step import StepParts


def step_layout(step: StepParts, sums: SumLayout) -> SumLayout:
    """The entries of a train call's step sums: the sums', then
    ``"skipped"`` and ``"loss_scale"`` where the step reports them."""
    dynamic = step.precision.loss_scale == "dynamic"
    skip = step.nan_policy == "skip" or dynamic
    extra = ("skipped",) if skip else ()
    return sums.plus(*extra, *(("loss_scale",) if dynamic else ()))


def eval_layout(
    step: StepParts, probe: Any, arguments: tuple[Any, ...], sums: dict[str, Any]
) -> SumLayout:
    """The entries of the eval step's packed sums: the train step's `sums`,
    or those of the trainer's own `eval_metrics` (the `probe` traced once
    more, on its abstract `arguments`)."""
    if step.eval_metrics is not None:
        _, sums = jax.eval_shape(ft.partial(probe, inference=True), *arguments)
    return sum_layout(sums)


def sum_layout(sums: dict[str, Any]) -> SumLayout:
    """The entries of packed sums, from the probe's (abstract) per-device
    sums: a mean's a scalar per device, a statistic's its total."""
    names, shapes, readers = [], [], []
    for name in sum_order(sums):
        entry = sums[name]
        names.append(name)
        if isinstance(entry, Summed):
            shapes.append(tuple(entry.total.shape[1:]))
            readers.append(entry.read)
        else:
            shapes.append(())
            readers.append(None)
    return SumLayout(tuple(names), tuple(shapes), tuple(readers))
