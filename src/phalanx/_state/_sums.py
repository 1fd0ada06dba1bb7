"""The sums a step returns and an epoch accumulates, packed on the devices.

A step's weighted sums (loss, weight, each metric) travel as one vector, and
an epoch's running sums as one vector plus one of integer flags: a step
has a few output buffers instead of one per scalar (each costs a buffer
on every device, and a Python array object per step). Names stay on the
host; means are taken there, once, when something reads them.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jaxtyping import Array, Float, Int

from .._typing import HostMetrics


# The epoch's integer flags, in order: steps skipped, and the first step with
# a non-finite gradient and that gradient's leaf (-1: none).
FLAGS = ("skipped", "nonfinite_step", "nonfinite_leaf")
NO_FLAGS = np.array([0, -1, -1], np.int32)


class EpochSums(NamedTuple):
    """An epoch's running sums on the devices.

    Attributes:
        sums: Σ weight · loss, Σ weight, Σ weight · metric, ... over the
            applied steps, in the order of the trainer's sum names.
        flags: the `FLAGS`.
    """

    sums: Float[Array, " sums"]
    flags: Int[Array, " 3"]


def sum_names(metric_names: Sequence[str]) -> tuple[str, ...]:
    """The order of a step's packed sums."""
    return ("loss", "weight", *metric_names)


# A step's trailing entries that are values, not sums to divide by the weight.
AS_THEY_ARE = ("skipped", "loss_scale")


def means(values: np.ndarray, names: Sequence[str]) -> HostMetrics:
    """Every sum but the weight divided once by the weight (in the sums'
    own precision, as the device would); trailing ``"skipped"`` and
    ``"loss_scale"`` entries are kept as they are. Over no weight at all
    (every step of an epoch skipped by ``nan_policy="skip"``) a mean is NaN,
    without numpy's warning about 0 / 0."""
    weight = values[names.index("weight")]
    with np.errstate(invalid="ignore", divide="ignore"):
        return {
            name: float(value if name in AS_THEY_ARE else value / weight)
            for name, value in zip(names, values, strict=True)
            if name != "weight"
        }


@dataclasses.dataclass(frozen=True)
class StepSums:
    """One step's packed sums, still on the devices: fetched and divided
    only when a callback reads `StepInfo.metrics`.

    Attributes:
        values: the step's sums, or (with `index`) the sums of every step of
            one compiled call, a row each.
        names: the sums' names.
        index: the step's row of `values`, if it holds several steps (the
            array is fetched once: JAX keeps its host copy).
    """

    values: Float[Array, " sums"] | Float[Array, "steps sums"]
    names: tuple[str, ...]
    index: int | None = None

    def means(self) -> HostMetrics:
        host: Any = jax.device_get(self.values)
        return means(host if self.index is None else host[self.index], self.names)
