"""Shared type aliases and the dimension names used in signatures.

Dimensions:
    batch: examples in one step's global batch, padding included.
    rows: the examples handed to `predict` (any number, no padding).
    example: the per-example axes of one leaf (``...`` in a signature).
    in, out: a model's input and output features.

Device arrays are typed with jaxtyping; host batches are NumPy pytrees with a
shared leading ``batch`` axis.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeAlias, TypeVar

import numpy as np
from jaxtyping import Array, Float, Int


ExampleIndex: TypeAlias = Int[Array, " batch"]
PerExample: TypeAlias = Float[Array, " batch"]
# A metric on the host: a float, or an array (a confusion matrix).
MetricValue: TypeAlias = float | np.ndarray
HostMetrics: TypeAlias = dict[str, MetricValue]


def scalar_metrics(metrics: HostMetrics) -> dict[str, float]:
    """The metrics that are numbers (leaving out arrays: a confusion matrix)."""
    return {k: v for k, v in metrics.items() if not isinstance(v, np.ndarray)}


# fit's evaluation sets: (the prefix of their metrics' names, their batches).
EvalSets: TypeAlias = tuple[tuple[str, Iterable[Any]], ...]
# ``loss=`` callables: (outputs, targets) -> one value per example.
LossFn: TypeAlias = Callable[[Any, Any], PerExample]
LossName: TypeAlias = Literal["cross_entropy", "categorical_cross_entropy", "mse"]
ChecksMode: TypeAlias = Literal["on", "off"]
NanPolicy: TypeAlias = Literal["raise", "skip", "off"]
# What fit does with Python's garbage collector (the trainer's ``gc=``).
GCMode: TypeAlias = Literal["auto", "off", "python"]
# A jax device (``jax.Device``, which type checkers cannot see as a class).
Device: TypeAlias = Any
# Strategy ``devices=``: None (all local), an int (the first n) or devices.
Devices: TypeAlias = None | int | Sequence[Device]


_F = TypeVar("_F", bound=Callable[..., Any])


def validates_own_arguments(fn: _F) -> _F:
    """Mark a public entry point that checks its own arguments.

    Its errors name the argument, its value and the fix. A runtime type
    checker (the jaxtyping import hook with beartype) would pre-empt them with
    generic messages, so it is told to skip this function: jaxtyping honours
    ``__no_type_check__``. Static checkers still see every annotation.
    """
    fn.__no_type_check__ = True  # pyright: ignore[reportFunctionMemberAccess]
    return fn
