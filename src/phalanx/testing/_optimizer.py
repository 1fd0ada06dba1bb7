"""What an optimizer makes of rounding: how far apart the updates of two
gradients that differ by rounding alone may land, per parameter leaf.

An optimizer that normalises the gradient (adam: ``m / (sqrt(v) + eps)``)
turns an entry that is zero up to rounding (a key bias under softmax, a bias
before BatchNorm, a unit that never fires) into a step of the learning
rate's size, in whichever direction the rounding points."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .._state._train_state import TrainState
from ..strategies._placement import on_device
from ._compare import Allowance, named_leaves


# The train step's program may round its gradient differently from
# compute_step's (another program, fused otherwise), by a similar amount:
# allow a few times the gap measured between the two runs' updates.
SPREAD = 4.0


Allowances = Callable[[TrainState, Any, Any, Any], dict[str, Allowance]]


def update_allowances(optimizer: optax.GradientTransformation) -> Allowances:
    """``allowances(state, want, have, zero) -> {path: Allowance}``: for the
    reference's gradient `want` and a set-up's `have`, from `state`; `zero`
    holds, per leaf, the magnitude below which an entry of `want` is zero up
    to rounding."""

    @jax.jit
    def measure(opt_state, params, want, have, zero):
        mine, _ = optimizer.update(want, opt_state, params)
        theirs, _ = optimizer.update(have, opt_state, params)
        gap = jax.tree.map(lambda a, b: jnp.max(jnp.abs(a - b)), mine, theirs)
        rounding = jax.tree.map(
            lambda u, g, z: jnp.max(jnp.where(jnp.abs(g) <= z, jnp.abs(u), 0)),
            mine,
            want,
            zero,
        )
        return gap, rounding

    def allowances(
        state: TrainState, want: Any, have: Any, zero: Any
    ) -> dict[str, Allowance]:
        params = eqx.filter(state.model, eqx.is_inexact_array)
        # On the reference's device: the set-up's gradient comes over.
        arguments = on_device(
            (state.opt_state, params, want, jax.device_get(have), zero),
            jax.devices()[0],
        )
        gap, rounding = measure(*arguments)
        return {
            path: Allowance(SPREAD * float(g) + 2 * float(r), float(r) > 0)
            for (path, g), (_, r) in zip(
                named_leaves(gap), named_leaves(rounding), strict=True
            )
        }

    return allowances
