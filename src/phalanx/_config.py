"""Validation of the trainer's arguments, before any device work."""

from collections.abc import Iterable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax

from ._callback import Callback, overrides
from ._placement import stacked
from ._precision import precision_of
from ._validate import (
    boolean,
    integer,
    one_of,
    optional_int_at_least,
    optional_positive_int,
    positive_int,
)
from .strategies import Strategy


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
    if not isinstance(optimizer, optax.GradientTransformation):
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
    if not (callable(loss) or loss in ("cross_entropy", "mse")):
        raise ValueError(
            f"loss={loss!r} is not supported; pass 'cross_entropy', 'mse' or a "
            "function (outputs, targets) -> per-example losses"
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


def check_duration(epochs: Any, steps: Any) -> tuple[int | None, int | None]:
    """Validate fit's `epochs` and `steps`; default to one epoch."""
    epochs = optional_positive_int("epochs", epochs)
    steps = optional_positive_int("steps", steps)
    if epochs is None and steps is None:
        epochs = 1
    return epochs, steps


_BATCHES = (
    "an iterable of batches, e.g. [(x, y)] for one batch, or "
    "px.data.ArrayLoader((x, y), batch_size=64) to batch and shuffle"
)


def check_iterable(
    data: Any,
    name: str,
    extra: tuple[Any, ...] = (),
    *,
    call: str = "fit",
    default_split: bool = True,
) -> None:
    """Raise TypeError unless `data` is an iterable of batches, and nothing
    followed it in `call` (`extra`, as in Keras' ``fit(x, y)``). Arrays given
    where batches belong are named as what they are, where the batches are
    split by the default `split_batch` (an overridden one may take any)."""
    if extra:
        raise TypeError(
            f"{call}() got {1 + len(extra)} positional arguments, as in Keras' "
            f"{call}(x, y); phalanx takes {_BATCHES}"
        )
    if not isinstance(data, Iterable):
        raise TypeError(
            f"{name}={type(data).__name__} is not iterable; pass {_BATCHES}"
        )
    if not default_split:
        return
    arrays = np.ndarray | jax.Array
    if isinstance(data, arrays):
        shape: tuple[int, ...] = data.shape  # pyright: ignore[reportAttributeAccessIssue]
        raise TypeError(
            f"{name} is one array of shape {shape}, not batches; pass {_BATCHES}"
        )
    if (
        isinstance(data, tuple | list)
        and len(data) in (2, 3)
        and all(isinstance(item, arrays) for item in data)
    ):
        raise TypeError(
            f"{name}=({', '.join(['x', 'y', 'sample_weight'][: len(data)])}) is one "
            f"batch, not an iterable of batches (iterating over it gives arrays); "
            f"pass {_BATCHES}"
        )


def check_monitors(callbacks: Sequence[Any], eval_data: Any) -> None:
    """Raise ValueError, before training, for a callback that monitors an
    ``eval_`` metric in a fit without `eval_data` (it would fail at the
    first epoch's end, after that epoch trained) - unless a callback of the
    user's own comes before it and may add that metric at each epoch's end
    (phalanx's own callbacks add no ``eval_`` metric)."""
    if eval_data is not None:
        return
    for i, callback in enumerate(callbacks):
        monitor = getattr(callback, "monitor", None)
        if not (isinstance(monitor, str) and monitor.startswith("eval_")):
            continue
        if any(
            overrides(earlier, "on_epoch_end")
            and not type(earlier).__module__.startswith("phalanx.")
            for earlier in callbacks[:i]
        ):
            continue
        raise ValueError(
            f"{type(callback).__name__}(monitor={monitor!r}) watches a metric "
            "of eval_data, but fit was given no eval_data; pass "
            f"eval_data=..., or monitor a training metric (e.g. "
            f"monitor={monitor.removeprefix('eval_')!r})"
        )
