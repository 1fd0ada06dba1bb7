"""What a call of `fit` or `evaluate` that Python cannot bind is told.

Keras' habits, ``fit(x, y, batch_size=128, validation_data=...)``, do not
fit phalanx's signatures, which take batches and nothing positional after
them, so a type checker flags such a call. At run time `binds_or_advises`
binds a call's arguments before the method runs and turns Python's bare
"takes 2 positional arguments" or "unexpected keyword argument" into
phalanx's way of doing each thing asked for. It checks nothing else.
"""

import difflib
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast, no_type_check

import jax
import numpy as np

from .._typing import validates_own_arguments


_F = TypeVar("_F", bound=Callable[..., Any])

LOADER = "px.data.ArrayLoader((x, y), batch_size=64)"
BATCHES = (
    f"an iterable of batches: {LOADER} to batch and shuffle arrays, or "
    "[(x, y)] for one batch"
)

# Keras' keyword arguments of fit and evaluate, and phalanx's way of each.
_KERAS: dict[str, str] = {
    "x": f"batches go in `data`, the first argument: fit({LOADER})",
    "y": f"labels travel inside the batches, as (x, y) pairs: {LOADER}",
    "batch_size": "the loader batches: px.data.ArrayLoader((x, y), batch_size=128) "
    "(a batch that does not divide over the devices is padded, exactly)",
    "validation_data": "pass eval_data=[(x_val, y_val)] (any re-iterable of batches, "
    "e.g. px.data.ArrayLoader((x_val, y_val), batch_size=256, shuffle=False); a "
    "dict of them names several sets); its metrics are named eval_loss, ...",
    "validation_split": "split the arrays yourself: n = int(0.8 * len(x)); "
    "fit(px.data.ArrayLoader((x[:n], y[:n]), batch_size=64), "
    "eval_data=[(x[n:], y[n:])])",
    "validation_freq": "eval_data is evaluated after every epoch, or after every N "
    "steps with eval_every=N",
    "validation_steps": "eval_data is evaluated whole; pass fewer batches, e.g. "
    "eval_data=list(itertools.islice(loader, n))",
    "validation_batch_size": "batch eval_data yourself: eval_data="
    "px.data.ArrayLoader((x_val, y_val), batch_size=256, shuffle=False)",
    "shuffle": "the loader shuffles: px.data.ArrayLoader((x, y), batch_size=64, "
    "shuffle=True) (a new, seeded permutation each epoch; shuffle=False keeps "
    "the order)",
    "verbose": "the display is the trainer's: DataParallelTrainer(..., "
    "progress=False) turns it off (a live bar on a terminal, a row per epoch "
    "elsewhere)",
    "callbacks": "callbacks belong to the trainer: DataParallelTrainer(..., "
    "callbacks=[...]), or trainer.callbacks = [...] between fits",
    "initial_epoch": "resume='latest' (with a px.callbacks.Checkpoint) continues a "
    "run at its checkpoint's epoch and step",
    "steps_per_epoch": "an epoch is one pass over the data; steps=N bounds the "
    "run's updates",
    "sample_weight": "weights travel inside the batches, as (x, y, sample_weight) "
    "triples: px.data.ArrayLoader((x, y, w), batch_size=64)",
    "class_weight": "override the trainer's sample_weight hook to return "
    "class_weight[labels] (see the models guide)",
    "steps_per_execution": "it is the trainer's steps_per_call=",
    "return_dict": "evaluate returns a dict already: {'loss': ..., 'accuracy': ...}",
}
# Keras' `steps` of evaluate (fit's `steps` is phalanx's own).
_EVALUATE_STEPS = (
    "evaluate takes every batch of data; pass fewer, e.g. "
    "list(itertools.islice(loader, n))"
)


def binds_or_advises(method: _F) -> _F:
    """`method`, binding each call's arguments first: a call it cannot take
    raises a TypeError saying how phalanx does what was asked (Keras'
    ``fit(x, y, batch_size=...)``), before the method runs. The method
    checks its own arguments (`validates_own_arguments`): a runtime type
    checker applied to it before this wrapper skips it too."""
    signature = inspect.signature(method)
    validates_own_arguments(method)

    # Not type-checked either (the jaxtyping import hook honours this).
    @functools.wraps(method)
    @no_type_check
    def bound(*args: Any, **kwargs: Any) -> Any:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as error:
            message = advice(method.__name__, signature, args[1:], kwargs, error)
            raise TypeError(message) from None
        return method(*args, **kwargs)

    return cast(_F, bound)


def advice(
    name: str,
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    error: TypeError,
) -> str:
    """What to do instead of the call ``name(*args, **kwargs)`` (a method,
    its ``self`` left out) that `signature` could not bind (`error`)."""
    parameters = [p for p in signature.parameters if p != "self"]
    positional = [
        p.name
        for p in signature.parameters.values()
        if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    fixes = []
    extra = args[len(positional) :]
    if extra:
        given = f"{len(args)} positional arguments ({', '.join(map(_short, args))})"
        if any(isinstance(arg, np.ndarray | jax.Array) for arg in extra):
            fixes.append(f"{given}, as in Keras' {name}(x, y): {name} takes {BATCHES}")
        else:
            keywords = [p for p in parameters if p not in positional]
            rest = (
                f" and the rest by keyword, e.g. {name}(data, {keywords[0]}=...)"
                if keywords
                else " alone"
            )
            fixes.append(f"{given}: {name} takes {', '.join(positional)}{rest}")
    for key, value in kwargs.items():
        if key in parameters:
            continue
        fix = _EVALUATE_STEPS if (name, key) == ("evaluate", "steps") else None
        fix = fix or _KERAS.get(key)
        if fix is None:
            close = difflib.get_close_matches(key, parameters, n=1)
            guess = f"did you mean {close[0]}=? " if close else ""
            fix = f"{name} takes no {key}=; {guess}it takes {', '.join(parameters)}"
        fixes.append(f"{key}={_short(value)}: {fix}")
    if not fixes:  # a missing or doubled argument: Python's words say it
        return f"{name}(): {error}; it takes {', '.join(parameters)}"
    if len(fixes) == 1:
        return f"{name}() got {fixes[0]}"
    lines = "\n".join(f"- {fix}" for fix in fixes)
    return f"{name}() was called as Keras' {name} is; phalanx's way of each:\n{lines}"


def _short(value: Any) -> str:
    """`value` in a few characters: an array by its type and shape."""
    if isinstance(value, np.ndarray | jax.Array):
        return f"{type(value).__name__}{list(value.shape)}"
    if isinstance(value, tuple | list) and value:
        inner = ", ".join(_short(item) for item in value[:3])
        more = ", ..." if len(value) > 3 else ""
        return f"({inner}{more})" if isinstance(value, tuple) else f"[{inner}{more}]"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
