"""The learning rate an optax optimizer's next update uses, read on the host
from the optimizer and its state: the rate `ReduceLROnPlateau` and
`LearningRateMonitor` log, the floor `min_lr` is compared with, and the base
`find_lr` divides its rates by to get the multiplier it sets
(`TrainState.lr_scale`).

phalanx's multiplier scales the optimizer's final update, which scales the
rate exactly where the update ends by multiplying by minus the rate, as every
optimizer optax builds does (`optax.scale_by_learning_rate`, the last link of
``optax.adam``'s chain). This module reads that factor through the
optimizer's update functions, as optax 0.2 builds them (their closures,
matched by code object, not by name): `optax.chain`, `optax.scale`,
`optax.scale_by_schedule`, `optax.inject_hyperparams` (a constant or a
schedule), `optax.multi_transform` and `optax.apply_if_finite`. It never
guesses: anything else (a transform after the rate, such as momentum or
clipping, or an optimizer written by hand) is reported as unknown, with why.
It only reads.
"""

import dataclasses
import inspect
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from optax._src import base as optax_base


@dataclasses.dataclass(frozen=True)
class NextRate:
    """What is known of the rate of an optimizer's next update.

    Attributes:
        value: the rate (before phalanx's multiplier); None: not known.
        why: where `value` is None, why: a clause completing "phalanx
            cannot read the optimizer's learning rate: ...".
    """

    value: float | None
    why: str = ""


def next_rate(optimizer: optax.GradientTransformation, opt_state: Any) -> NextRate:
    """The learning rate of `optimizer`'s next update from `opt_state`: minus
    the factor its update ends by (the trailing `optax.scale` and
    `optax.scale_by_schedule` links, multiplied; a lone ``optax.scale(-1)``
    after other transforms is a sign flip, as in ``optax.adafactor``).

    With several groups (`optax.multi_transform`), the rate of the first
    group in the mapping's order that has one (a group frozen with
    `optax.set_to_zero` has none); every other group's rate must be known
    too, since phalanx's one multiplier scales them all.
    """
    tail = _tail(optimizer.update, opt_state)
    if tail.factor is None:
        return NextRate(None, tail.why)
    if not -tail.factor >= 0:  # NaN too
        return NextRate(
            None,
            f"its update ends by multiplying by {tail.factor:g}, not by minus a "
            "learning rate",
        )
    return NextRate(-tail.factor)


@dataclasses.dataclass(frozen=True)
class _Tail:
    """What a transform's update ends by.

    Attributes:
        factor: the scalar its update is multiplied by last; None: unknown.
        pure: the transform does nothing but that (`optax.scale`,
            `optax.scale_by_schedule`, `optax.identity`: factor 1), so a
            chain reads on through the links before it.
        why: where `factor` is None, why.
        frozen: the update is 0 whatever the rate (`optax.set_to_zero`).
    """

    factor: float | None
    pure: bool = False
    why: str = ""
    frozen: bool = False


def _code_of(update: Callable) -> Any:
    """The code object of a function; None for a method or another callable
    (no transform this module reads)."""
    return update.__code__ if isinstance(update, types.FunctionType) else None


def _code(transform: optax.GradientTransformation) -> Any:
    return _code_of(transform.update)


# The update functions optax builds, known by their code objects (a function
# made by the same factory shares its code): robust to optax moving them
# between modules, as 0.2 did with chain and multi_transform.
_CHAIN = _code(optax.chain(optax.identity()))
_EXTRA_ARGS = _code(optax_base.with_extra_args_support(optax.identity()))
_IDENTITY = _code(optax.identity())
_SCALE = _code(optax.scale(1.0))
_SCHEDULE = _code(optax.scale_by_schedule(lambda count: count))
_INJECTED = _code(optax.inject_hyperparams(optax.sgd)(learning_rate=1.0))
_GROUPS = _code(optax.multi_transform({"a": optax.identity()}, lambda p: p))
_IF_FINITE = _code(optax.apply_if_finite(optax.identity(), 1))
_ZERO = _code(optax.set_to_zero())


def _tail(update: Callable, state: Any) -> _Tail:
    """What the transform whose update function is `update`, in `state`,
    ends by."""
    code = _code_of(update)
    try:
        cells = {} if code is None else _closure(update)
        if code is _EXTRA_ARGS:
            return _tail(cells["tx"].update, state)
        if code is _IDENTITY:
            return _Tail(1.0, pure=True)
        if code is _SCALE:
            return _scalar(cells["step_size"], "optax.scale")
        if code is _SCHEDULE:
            step_size = cells["step_size_fn"](_host(state.count))
            return _scalar(step_size, "optax.scale_by_schedule")
        if code is _CHAIN:
            return _chain(cells["update_fns"], state)
        if code is _IF_FINITE:  # the inner update, or zeros
            return dataclasses.replace(
                _tail(cells["inner"].update, state.inner_state), pure=False
            )
        if code is _INJECTED:
            return _injected(cells, state)
        if code is _GROUPS:
            return _groups(cells["transforms"], state.inner_states)
        if code is _ZERO:
            return _Tail(None, why="it is frozen (optax.set_to_zero)", frozen=True)
    except (KeyError, AttributeError, IndexError, TypeError, ValueError) as error:
        # An optax that builds its transforms otherwise than 0.2.
        return _Tail(
            None,
            why=f"optax {optax.__version__} builds {_name(update)} otherwise "
            f"than phalanx reads it ({type(error).__name__}: {error})",
        )
    return _Tail(
        None,
        why=f"its update ends with {_name(update)}, not with its learning rate "
        "(optax.scale_by_learning_rate, the last transform of optax's "
        "optimizers), so the update need not be proportional to the rate",
    )


def _chain(updates: tuple[Callable, ...], states: tuple[Any, ...]) -> _Tail:
    """The factor a chain ends by: the product of its trailing pure links'
    factors, and of the next link's where it has one."""
    factor, flipped, found = 1.0, False, False
    for update, state in zip(reversed(updates), reversed(states), strict=True):
        tail = _tail(update, state)
        if tail.pure:
            assert tail.factor is not None, "a pure link has a factor"
            if tail.factor == -1.0 and not found:
                flipped = not flipped  # a sign flip, or a rate of 1: see below
            elif tail.factor != 1.0:
                found = True
            factor *= tail.factor
            continue
        if tail.factor is not None:
            return _Tail(factor * tail.factor)
        if found:
            return _Tail(factor)
        if flipped:
            tail = _Tail(
                None,
                why=f"its update ends with optax.scale(-1) after "
                f"{_name(update)}: a sign flip (as in optax.adafactor) or a "
                "rate of 1, which phalanx cannot tell apart",
            )
        return tail
    return _Tail(factor, pure=True)  # scales only: together, the rate


def _scalar(step_size: Any, transform: str) -> _Tail:
    """A link multiplying the update by `step_size`."""
    value = np.asarray(_host(step_size))
    if value.shape != () or value.dtype.kind not in "fiu":
        return _Tail(None, why=f"its update ends with {transform}, not by a scalar")
    return _Tail(float(value), pure=True)


def _injected(cells: Mapping[str, Any], state: Any) -> _Tail:
    """An `optax.inject_hyperparams` optimizer's tail: its inner optimizer
    built, as its update builds it, from the hyperparameters the next update
    uses (a constant's from the state, a schedule's at its next count)."""
    hyperparams = {name: _host(value) for name, value in state.hyperparams.items()}
    for name, schedule in cells["sched_hps"].items():
        schedule_state = jax.tree.map(_host, state.hyperparams_states[name])
        hyperparams[name] = _host(schedule(schedule_state))
    inner = cells["inner_factory"](**cells["other_hps"], **hyperparams)
    return dataclasses.replace(_tail(inner.update, state.inner_state), pure=False)


def _groups(transforms: dict[str, Any], states: dict[str, Any]) -> _Tail:
    """An `optax.multi_transform`'s tail: its first group's with a rate."""
    tails = {
        name: _tail(tx.update, states[name].inner_state)
        for name, tx in transforms.items()
    }
    unknown = [
        f"group {name!r}: {tail.why}"
        for name, tail in tails.items()
        if tail.factor is None and not tail.frozen
    ]
    if unknown:
        return _Tail(None, why="; ".join(unknown))
    known = [tail.factor for tail in tails.values() if tail.factor is not None]
    if not known:
        return _Tail(None, why="every group is frozen (optax.set_to_zero)")
    return _Tail(known[0])


def _closure(update: Callable) -> Mapping[str, Any]:
    """The variables the function `update` closes over, by name."""
    return inspect.getclosurevars(update).nonlocals


def _host(value: Any) -> Any:
    """A replicated array as a NumPy value of this process's copy (a
    multi-process array is not whole on any one process); anything else
    unchanged."""
    if isinstance(value, jax.Array):
        return np.asarray(value.addressable_data(0))
    return value


def _name(update: Callable) -> str:
    """How a transform's update function is named to a user, e.g.
    ``clip_by_global_norm`` for ``clip_by_global_norm.<locals>.update_fn``."""
    while _code_of(update) is _EXTRA_ARGS:
        update = _closure(update)["tx"].update
    if isinstance(update, types.FunctionType | types.MethodType):
        return update.__qualname__.split(".<locals>")[0]
    return type(update).__name__


def multiplier(lr_scale: Any) -> float:
    """A state's rate multiplier (`TrainState.lr_scale`) as a float, from this
    process's copy."""
    return float(_host(lr_scale))


def used_rate(optimizer: optax.GradientTransformation, state: Any) -> float | None:
    """The rate `state`'s next update uses: the optimizer's (`next_rate`)
    times the state's multiplier (`TrainState.lr_scale`); None where the
    optimizer's cannot be read."""
    base = next_rate(optimizer, state.opt_state).value
    return None if base is None else base * multiplier(state.lr_scale)
