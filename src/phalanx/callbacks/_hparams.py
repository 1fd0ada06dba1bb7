"""What an experiment tracker records of a run's settings (its
hyperparameters), read from the trainer and from the user's own config."""

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeAlias

import equinox as eqx
import jax

from ._base import TrainerLike


# A tracker's hyperparameter value (W&B config, MLflow params).
Scalar: TypeAlias = str | int | float | bool


def hyperparameters(trainer: TrainerLike) -> dict[str, Scalar]:
    """The trainer's settings, flat, with dotted names.

    Read from what `TrainerLike` declares (nothing is probed for):

    - ``strategy``: the strategy's class name; ``strategy.num_devices``; and
      ``strategy.<field>`` for each scalar field (``strategy.inner`` and its
      fields for a wrapping strategy);
    - ``precision`` (``"fp32"``, ``"bf16"``, ...), ``steps_per_call``,
      ``nan_policy`` and ``sync_every``;
    - ``model``: the model's class name; ``model.parameters``: the number
      of floating-point parameters;
    - ``optimizer_state``: the optax state classes in the optimizer state, in
      order (e.g. ``"ScaleByAdamState"``), or ``"none"``: an optax
      `GradientTransformation` has no readable name, its state does.

    The seed is not among them (a trainer keeps its key, not the seed it was
    made from): a run records it in the tracker's ``config=``, as
    ``phalanx train`` does.

    Example:
        ```python
        from phalanx.callbacks._hparams import hyperparameters

        hyperparameters(trainer)
        # {"strategy": "ShardingStrategy", "strategy.num_devices": 8, ...,
        #  "model": "MLP", "model.parameters": 67, "optimizer_state": ...}
        ```
    """
    params = _fields("strategy", trainer.strategy)
    params["strategy.num_devices"] = trainer.strategy.num_devices
    params["precision"] = trainer.precision.describe()
    params["steps_per_call"] = trainer.steps_per_call
    params["nan_policy"] = trainer.nan_policy
    params["sync_every"] = trainer.sync_every
    state = trainer.state
    params["model"] = type(state.model).__name__
    leaves = jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array))
    params["model.parameters"] = sum(int(leaf.size) for leaf in leaves)
    names = _state_names(state.opt_state)
    params["optimizer_state"] = ", ".join(names) if names else "none"
    return params


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`config` with nested mappings flattened to dotted names
    (``{"data": {"batch": 64}}`` → ``{"data.batch": 64}``)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def check_config(config: object) -> dict[str, Any]:
    """A copy of `config` if it is None or a mapping with str keys.

    Raises:
        TypeError: anything else (the message names the offending key).
    """
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise TypeError(
            f"config={config!r} must be a mapping of names to values, e.g. "
            f"config={{'lr': 1e-3}}, not {type(config).__name__}"
        )
    for key in config:
        if not isinstance(key, str):
            raise TypeError(
                f"config has the key {key!r}; its keys must be str, e.g. "
                "config={'lr': 1e-3}"
            )
    return dict(config)


def _fields(prefix: str, module: object) -> dict[str, Scalar]:
    """``prefix``: the class name; ``prefix.<field>`` for each scalar field of
    a dataclass (an `eqx.Module`), recursing into dataclass fields."""
    params: dict[str, Scalar] = {prefix: type(module).__name__}
    if not dataclasses.is_dataclass(module):
        return params
    for field in dataclasses.fields(module):
        # A user's strategy may be a plain dataclass whose ``init=False``
        # field was never set (an `eqx.Module` refuses that when built):
        # such a field is left out rather than failing the tracker.
        value = getattr(module, field.name, None)
        name = f"{prefix}.{field.name}"
        if isinstance(value, Scalar):
            params[name] = value
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            params.update(_fields(name, value))
    return params


def _state_names(tree: object) -> list[str]:
    """The optax state classes in an optimizer state, in order.

    Optax states are NamedTuples; `optax.chain` nests them in plain tuples
    and wrappers (``MultiSteps``, ``inject_hyperparams``) hold inner states
    as fields. ``EmptyState`` (a stateless transformation) is left out.
    """
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        name = type(tree).__name__
        inner = [n for child in tree for n in _state_names(child)]
        return inner if name == "EmptyState" else [name, *inner]
    if isinstance(tree, tuple | list):
        return [n for child in tree for n in _state_names(child)]
    if isinstance(tree, dict):
        return [n for child in tree.values() for n in _state_names(child)]
    return []
