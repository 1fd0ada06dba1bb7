"""Validation of the trainer's arguments, before any device work."""

import re
import typing
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax

from .._losses import LOSSES
from .._precision import precision_of
from .._state._progress import RunProgress
from .._telemetry._watchdog import check_hang_timeout
from .._typing import EvalSets, GCMode
from .._validate import (
    boolean,
    integer,
    is_real,
    one_of,
    optional_int_at_least,
    optional_positive_int,
    positive_int,
)
from ..callbacks._base import Callback
from ..strategies import Strategy
from ..strategies._placement import stacked
from ._keras_habits import BATCHES


def check_config(
    *,
    model: Any,
    optimizer: Any,
    strategy: Any,
    loss: Any,
    callbacks: Any,
    seed: Any,
    model_state: Any,
    checks: Any,
    nan_policy: Any,
    sync_every: Any,
    prefetch: Any,
    steps_per_call: Any = 1,
    precision: Any = "fp32",
    progress: Any = True,
    ema: Any = None,
    gc: Any = "auto",
    slow_steps: Any = 3.0,
    hang_timeout: Any = "auto",
) -> None:
    """Raise TypeError / ValueError naming the first bad trainer argument."""
    if not callable(model):
        raise TypeError(
            f"model={model!r} is not callable; pass an Equinox module whose "
            "__call__ takes one example, e.g. px.models.MLP(64, 10, key=key)"
        )
    if not jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)):
        raise ValueError(
            f"model={type(model).__name__} has no floating-point arrays, so "
            "there is nothing to train; give it parameters (e.g. "
            "eqx.nn.Linear layers), or call it directly for inference"
        )
    if isinstance(optimizer, Mapping) and optimizer:
        for name, each in optimizer.items():
            if not isinstance(name, str) or not isinstance(
                each, optax.GradientTransformation
            ):
                raise TypeError(
                    f"optimizer[{name!r}]={each!r}: a mapping of parameter groups "
                    "takes group names (str) to optax transformations, e.g. "
                    "{'generator': optax.adam(2e-4), 'discriminator': "
                    "optax.adam(2e-4)}"
                )
    elif not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"optimizer={optimizer!r} is not an optax GradientTransformation; pass "
            "one such as optax.adam(1e-3) (an optax alias called with its "
            "hyperparameters, not the function itself)"
        )
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(
            f"strategy={strategy!r} is not a phalanx Strategy; pass "
            "px.ShardingStrategy(), px.PmapStrategy(), px.FullyShardedStrategy() or "
            "px.AccumulatingStrategy(...)"
        )
    if not (callable(loss) or loss in LOSSES):
        raise ValueError(
            f"loss={loss!r} is not supported; pass {', '.join(map(repr, LOSSES))} "
            "or a function (outputs, targets) -> per-example losses"
        )
    check_callbacks(callbacks)
    integer("seed", seed, example="seed=0")
    if model_state is not None and not isinstance(model_state, eqx.nn.State):
        raise TypeError(
            f"model_state={type(model_state).__name__} is not an eqx.nn.State; pass "
            "the state from eqx.nn.make_with_state, or None"
        )
    one_of("checks", checks, ("on", "off"))
    one_of("nan_policy", nan_policy, ("raise", "skip", "off"))
    positive_int("sync_every", sync_every, example="16")
    positive_int("steps_per_call", steps_per_call, example="8")
    precision_of(precision)
    boolean("progress", progress)
    check_ema(ema)
    one_of("gc", gc, typing.get_args(GCMode))
    if slow_steps is not None and not (is_real(slow_steps) and float(slow_steps) > 1):
        raise ValueError(
            f"slow_steps={slow_steps!r}: pass the factor over the median step "
            "time at which a slow step is reported, a number above 1 (e.g. "
            "slow_steps=3.0), or None for no report"
        )
    check_hang_timeout(hang_timeout)
    if steps_per_call > 1 and strategy is not None:
        stacked(strategy.batch_sharding)  # the strategy can stack batches
    optional_int_at_least(
        "prefetch",
        prefetch,
        0,
        example="2",
        hint="batches prepared ahead: 0 prepares each batch when its step runs, "
        "None chooses by the devices",
    )


def check_ema(ema: Any) -> None:
    """`ema` must be None or a decay strictly between 0 and 1."""
    if ema is None:
        return
    if not is_real(ema) or not 0 < float(ema) < 1:
        raise ValueError(
            f"ema={ema!r}: pass the decay of the weights' moving average, a "
            "number strictly between 0 and 1 (e.g. ema=0.999: each step moves "
            "the average 0.1% of the way to the weights), or None for none"
        )


def check_callbacks(callbacks: Any) -> None:
    """Raise TypeError unless `callbacks` is a sequence of `Callback`s."""
    if isinstance(callbacks, Callback) or not isinstance(callbacks, Iterable):
        raise TypeError(f"callbacks={callbacks!r} must be a sequence of px.Callback")
    for callback in callbacks:
        if not isinstance(callback, Callback):
            raise TypeError(
                f"callbacks contains {callback!r}, which is not a px.Callback; "
                "subclass px.Callback and override its hooks"
            )


_SET_NAME = re.compile(r"[A-Za-z0-9_]+")


def eval_sets(eval_data: Any, *, default_split: bool = True) -> EvalSets | None:
    """`fit`'s `eval_data` as its sets, checked: one iterable of batches
    (metrics ``eval_loss``, ...), or a mapping of names to them (metrics
    ``eval_<name>_loss``, ...); None for none."""
    if eval_data is None:
        return None
    if not isinstance(eval_data, Mapping):
        check_iterable(eval_data, "eval_data", default_split=default_split)
        return (("eval_", eval_data),)
    if not eval_data:
        raise ValueError(
            "eval_data={} has no sets; pass batches, or a mapping of names to "
            "batches, e.g. eval_data={'val': val_batches, 'test': test_batches}"
        )
    if default_split and set(eval_data) <= {"x", "y", "sample_weight"}:
        raise TypeError(
            f"eval_data is one dict batch with keys {sorted(eval_data)}, not "
            f"batches; pass [batch], or {BATCHES}"
        )
    sets = []
    for name, data in eval_data.items():
        if not (isinstance(name, str) and _SET_NAME.fullmatch(name)):
            raise ValueError(
                f"eval_data has a set named {name!r}; name each set with letters, "
                "digits and underscores (its metrics are eval_<name>_loss, ...), "
                "e.g. eval_data={'val': val_batches}"
            )
        check_iterable(data, f"eval_data[{name!r}]", default_split=default_split)
        sets.append((f"eval_{name}_", data))
    return tuple(sets)


def check_eval_every(eval_every: Any, sets: EvalSets | None) -> int | None:
    """Validate fit's `eval_every` (steps between evaluations, or None)."""
    eval_every = optional_positive_int("eval_every", eval_every)
    if eval_every is not None and sets is None:
        raise ValueError(
            f"eval_every={eval_every} evaluates eval_data every {eval_every} steps, "
            "but fit was given no eval_data; pass eval_data=..., or leave "
            "eval_every=None"
        )
    return eval_every


def check_duration(epochs: Any, steps: Any) -> tuple[int | None, int | None]:
    """Validate fit's `epochs` and `steps`; default to one epoch."""
    epochs = optional_positive_int("epochs", epochs)
    steps = optional_positive_int("steps", steps)
    if epochs is None and steps is None:
        epochs = 1
    return epochs, steps


def check_iterable(
    data: Any,
    name: str,
    *,
    default_split: bool = True,
) -> None:
    """Raise TypeError unless `data` is an iterable of batches. Arrays given
    where batches belong are named as what they are, where the batches are
    split by the default `split_batch` (an overridden one may take any)."""
    if not isinstance(data, Iterable):
        raise TypeError(f"{name}={type(data).__name__} is not iterable; pass {BATCHES}")
    if not default_split:
        return
    arrays = np.ndarray | jax.Array
    if isinstance(data, arrays):
        shape: tuple[int, ...] = data.shape  # pyright: ignore[reportAttributeAccessIssue]
        raise TypeError(
            f"{name} is one array of shape {shape}, not batches; pass {BATCHES}"
        )
    if (
        isinstance(data, tuple | list)
        and len(data) in (2, 3)
        and all(isinstance(item, arrays) for item in data)
    ):
        raise TypeError(
            f"{name}=({', '.join(['x', 'y', 'sample_weight'][: len(data)])}) is one "
            f"batch, not an iterable of batches (iterating over it gives arrays); "
            f"pass {BATCHES}"
        )


_REITERABLE = (
    "pass a re-iterable instead: a list of batches, px.data.ArrayLoader(...), "
    "or an object whose __iter__ makes a new generator each time"
)


def check_one_shot(
    data: Any,
    sets: EvalSets | None,
    progress: RunProgress,
    *,
    total_steps: int | None,
    eval_every: int | None,
) -> None:
    """Raise ValueError, before the first step, where a one-shot iterator
    (a generator) would be read more often than once: `data` over more than
    one pass, or an evaluation set at more than one evaluation. A count that
    is not known up front (``steps=`` over an endless generator) is trusted.

    Args:
        data, sets: `fit`'s training data and evaluation sets.
        progress: where the run stands, with this fit's plan.
        total_steps: the steps the run makes from its start, where known.
        eval_every: `fit`'s ``eval_every``.
    """
    plan = progress.plan
    passes = None
    if plan.epochs is not None and plan.steps is None:
        passes = plan.start_epoch + plan.epochs - progress.epoch
    if isinstance(data, Iterator) and passes is not None and passes > 1:
        raise ValueError(
            f"data is a one-shot iterator ({type(data).__name__}), used up after "
            f"one pass, but epochs={plan.epochs} makes {passes} passes over it; "
            f"{_REITERABLE}, or epochs=1 (an endless generator: steps=N alone)"
        )
    evaluations = passes
    if eval_every is not None:
        evaluations = None
        if total_steps is not None:
            end = plan.start_step + total_steps
            evaluations = end // eval_every - progress.step // eval_every
    for prefix, batches in sets or ():
        if isinstance(batches, Iterator) and evaluations and evaluations > 1:
            where = "eval_data" if prefix == "eval_" else f"eval_data[{prefix[5:-1]!r}]"
            when = (
                "at each epoch's end"
                if eval_every is None
                else f"every {eval_every} steps"
            )
            raise ValueError(
                f"{where} is a one-shot iterator ({type(batches).__name__}), used "
                f"up after one evaluation, but this fit evaluates it {when}, "
                f"{evaluations} times; {_REITERABLE} (e.g. list({where}))"
            )
