"""An optimizer's hyperparameters kept in its state by
`optax.inject_hyperparams`: read and set between steps (the learning rate
`ReduceLROnPlateau` lowers and `find_lr` sweeps)."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


_INJECTED = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def is_injected(node: Any) -> bool:
    """Whether `node` is the state of an `optax.inject_hyperparams` optimizer."""
    return isinstance(node, _INJECTED)


def injected(opt_state: Any, hyperparam: str, user: str) -> list[Any]:
    """The `optax.inject_hyperparams` states of `opt_state` holding
    `hyperparam`.

    Raises:
        TypeError: there is none (the message names `user`, what needs it).
    """
    nodes = jax.tree.leaves(opt_state, is_leaf=is_injected)
    found = [n for n in nodes if is_injected(n) and hyperparam in n.hyperparams]
    if not found:
        raise TypeError(
            f"{user}: the optimizer keeps no {hyperparam!r} in its state, so it "
            "cannot be changed between steps; build it with "
            "optax.inject_hyperparams, e.g. "
            f"optax.inject_hyperparams(optax.adam)({hyperparam}=1e-3)"
        )
    return found


def hyperparam_value(opt_state: Any, hyperparam: str, user: str) -> float:
    """The first injected `hyperparam` of `opt_state`, as a float."""
    return _as_float(injected(opt_state, hyperparam, user)[0].hyperparams[hyperparam])


def _as_float(value: Any) -> float:
    """A scalar hyperparameter as a float, read from this process's copy (it
    is replicated: a multi-process array is not whole on any one process)."""
    if isinstance(value, jax.Array):
        value = value.addressable_data(0)
    return float(np.asarray(value))


def with_hyperparam(opt_state: Any, hyperparam: str, new: Any) -> Any:
    """`opt_state` with every injected `hyperparam` set by ``new(old)``
    (``old`` a float), in the dtype it had."""

    def replace(node: Any) -> Any:
        if not is_injected(node) or hyperparam not in node.hyperparams:
            return node
        old = node.hyperparams[hyperparam]
        updated = jnp.asarray(new(_as_float(old)), jnp.asarray(old).dtype)
        return node._replace(hyperparams={**node.hyperparams, hyperparam: updated})

    return jax.tree.map(replace, opt_state, is_leaf=is_injected)
