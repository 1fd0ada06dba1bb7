"""The sums a step returns and an epoch accumulates, packed on the devices.

A step's weighted sums (loss, weight, each metric) travel as one vector, and
an epoch's running sums as one vector plus one of integer flags: a step
has a few output buffers instead of one per scalar (each costs a buffer
on every device, and a Python array object per step). Names stay on the
host; means are taken there, once, when something reads them.
"""

import dataclasses
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeAlias

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


# Reads an entry's total over every example into its metric (a float, or an
# array such as a confusion matrix); None: a mean, divided by the weight.
Reader: TypeAlias = Callable[[np.ndarray], float | np.ndarray] | None


def _as_is(total: np.ndarray) -> float:
    """A step's trailing entries (``"skipped"``, ``"loss_scale"``) are
    values, not sums to divide by the weight."""
    return float(total)


def sum_order(names: Iterable[str]) -> list[str]:
    """The order of a step's packed sums: ``"loss"``, ``"weight"``, then the
    metrics by name (as JAX orders a dict's leaves: the step packs its
    dict, and the layout reads the probe's, in this one order)."""
    rest = sorted(set(names) - {"loss", "weight"})
    return ["loss", "weight", *rest]


@dataclasses.dataclass(frozen=True)
class SumLayout:
    """The entries of a step's packed sums, in order: ``"loss"``,
    ``"weight"``, then each metric's, with the shape of its sum (``()``
    for a mean) and how the host reads it.

    Attributes:
        names: the entries' names.
        shapes: each entry's shape (it takes their product of the vector).
        readers: each entry's `Reader`.
    """

    names: tuple[str, ...] = ("loss", "weight")
    shapes: tuple[tuple[int, ...], ...] = ((), ())
    readers: tuple[Reader, ...] = (None, None)

    @property
    def size(self) -> int:
        """The length of the packed vector."""
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """What the sums are read into, ``"loss"`` first."""
        return tuple(name for name in self.names if name != "weight")

    def plus(self, *names: str) -> "SumLayout":
        """This layout and trailing scalar entries read as they are."""
        return SumLayout(
            (*self.names, *names),
            (*self.shapes, *[()] * len(names)),
            (*self.readers, *[_as_is] * len(names)),
        )

    def means(self, values: np.ndarray) -> HostMetrics:
        """The metrics from packed sums: a mean's sum divided once by the
        weight (in the sums' own precision, as the device would), a
        statistic's total read by its reader. Over no weight at all (every
        step of an epoch skipped by ``nan_policy="skip"``) a mean is NaN,
        without numpy's warning about 0 / 0."""
        values = np.asarray(values)
        ends = np.cumsum([math.prod(shape) for shape in self.shapes])
        totals = np.split(values, ends[:-1])
        weight = totals[self.names.index("weight")][0]
        metrics: HostMetrics = {}
        with np.errstate(invalid="ignore", divide="ignore"):
            for name, shape, reader, total in zip(
                self.names, self.shapes, self.readers, totals, strict=True
            ):
                if name == "weight":
                    continue
                if reader is None:
                    metrics[name] = float(total[0] / weight)
                else:
                    metrics[name] = reader(total.reshape(shape))
        return metrics


@dataclasses.dataclass(frozen=True)
class StepSums:
    """One step's packed sums, still on the devices: fetched and divided
    only when a callback reads `StepInfo.metrics`.

    Attributes:
        values: the step's sums, or (with `index`) the sums of every step of
            one compiled call, a row each.
        layout: the sums' entries.
        index: the step's row of `values`, if it holds several steps (the
            array is fetched once: JAX keeps its host copy).
    """

    values: Float[Array, " sums"] | Float[Array, "steps sums"]
    layout: SumLayout
    index: int | None = None

    def means(self) -> HostMetrics:
        host: Any = jax.device_get(self.values)
        return self.layout.means(host if self.index is None else host[self.index])
