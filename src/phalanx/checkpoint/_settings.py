"""The settings of a run that shape every update, and the one-line refusal
of a resume that would change them.

A checkpoint's arrays say which model and optimizer a run has (their paths,
shapes and dtypes: `_leaf_spec.py`), not how the updates are made: the
moving average's decay (``ema=``), the precision the step computes in, the
built-in loss, which parameters each optimizer of a mapping trains
(``param_groups``), the optimizer's learning rate (at its first update,
where phalanx can read it; compared as float32, what the update computes
in). Changed on resume, each would leave the arrays fitting
and make every update from there on another run's, silently. The trainer
records them (`run_settings`), a `Snapshot` carries them, a checkpoint
keeps them in its JSON half, and a resume compares (`check_same_settings`)
before anything is restored. Settings that change no update (the strategy,
the device count, ``steps_per_call``, callbacks, evaluation) are not here.
Checkpoints written before settings were kept hold none, and are not
compared.
"""

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def run_settings(
    *,
    ema: float | None,
    precision: str,
    loss: str | None,
    groups: Sequence[tuple[str, str]] | None,
    learning_rate: float | None,
) -> dict[str, Any]:
    """A trainer's settings that shape its updates, as plain (JSON) data.

    Args:
        ema: the moving average's decay (None: none kept).
        precision: the precision's name (`Precision.describe`).
        loss: the built-in loss's name; None for a loss function (whose
            identity a checkpoint cannot tell).
        groups: each parameter's path and the group that trains it, where
            the optimizer is a mapping of groups; None for one optimizer.
        learning_rate: the rate of the optimizer's first update (before the
            run's multiplier), where phalanx can read it (None: it cannot):
            ``optax.adam(1e-3)`` resumed as ``optax.adam(1e-4)`` would be
            another run.
    """
    return {
        "ema": ema,
        "precision": precision,
        "loss": loss,
        "param_groups": None if groups is None else [list(pair) for pair in groups],
        "learning_rate": learning_rate,
    }


def check_same_settings(
    mine: Mapping[str, Any], saved: Mapping[str, Any], where: str
) -> None:
    """Raise ValueError, in one line, where `saved` (the run `where` holds)
    has another value than `mine` (this trainer's) for a setting both
    record.

    Args:
        where: what holds `saved`, e.g. ``"checkpoint runs/a/7"``.
    """
    # Compared as a checkpoint holds them: JSON (tuples are lists there).
    mine = json.loads(json.dumps(dict(mine)))
    for name, value in mine.items():
        if name not in saved:  # not recorded when `where` was written
            continue
        old = saved[name]
        unknown = name in _UNKNOWN_AS_NONE and (value is None or old is None)
        if _same(name, value, old) or unknown:
            continue
        theirs, ours = _shown(name, old, value), _shown(name, value, old)
        raise ValueError(
            f"{where} is of a run with {theirs}, but this trainer has {ours}: "
            "resumed, every update from there on would be another run's; build "
            f"the trainer with {theirs} to continue that run, or start a new "
            "run without resume"
        )


# Settings recorded as None where the trainer cannot tell them (a loss
# function, an optimizer whose rate phalanx cannot read): not compared then.
_UNKNOWN_AS_NONE = ("loss", "learning_rate")


def _same(name: str, value: Any, old: Any) -> bool:
    """Whether a setting's `value` is `old`: learning rates as float32 (what
    the update computes in: a rate a schedule computed in float32, as
    ``phalanx train --lr 0.01``'s, is 0.009999999776482582 as a float, and
    moves the float32 parameters as ``optax.adam(0.01)`` does)."""
    if name == "learning_rate" and _is_rate(value) and _is_rate(old):
        return bool(np.float32(value) == np.float32(old))
    return value == old


def _is_rate(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shown(name: str, value: Any, other: Any) -> str:
    """A setting's `value` as the trainer's argument says it; parameter
    groups by what first differs from `other`."""
    if name == "learning_rate":
        # The shortest digits that tell its float32 from every other: rates
        # compared unequal are shown unequal.
        rate = str(np.float32(value))
        return f"an optimizer whose first update's learning rate is {rate}"
    if name != "param_groups":
        return f"{name}={value!r}"
    if value is None:
        return "one optimizer for every parameter"
    if other is None or _names(value) != _names(other):
        return f"the parameter groups {_names(value)}"
    theirs = dict(map(tuple, other))
    for path, group in value:
        if theirs.get(path) != group:
            return f"param_groups putting {path} in group {group!r}"
    return f"the parameter groups {_names(value)}"


def _names(pairs: list[list[str]]) -> list[str]:
    """The groups of `pairs` ([path, group], ...), sorted."""
    return sorted({group for _, group in pairs})
