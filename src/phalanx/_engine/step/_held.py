"""The held guard: ``nan_policy="raise"`` at no cost to the step, by
checking a step's gradient while the next step runs, and holding the state
from before it until then.

A guard that decides inside the step whether its update lands makes the
update wait for a reduction over the whole gradient, so XLA cannot fuse the
gradient's last matmuls into the optimizer's pass: on a TPU v5e (an MLP
1024-4096×3-10, batch 4096, adam) that cost 0.38 ms of a 6.70 ms step
(a `jnp.where` on the new state; a `lax.cond` and an update multiplied by
0 or 1 measured alike). Checking it without gating the update costs 0.03
ms. So
here each step applies its update unconditionally and records whether its
gradient was finite (in the epoch's flags, as the gated guard does); the
*next* step, knowing that before it starts, runs under a `lax.cond`: a
step after a bad one trains nothing and returns the state from before the
bad step. That state is the spare: the state the previous call read, which
the next call takes as well and donates as the buffers of its output (so
the step updates out of place: a bare JAX step so guarded took 6.47–6.54
ms there, and the trainer's default ran at 0.996 of a hand-written loop,
with no guard at 0.997, gated at 0.942; on the tests' transformer, 6
layers of width 512, bf16, 25.44 ms a step held, 25.57 gated, 25.53 by
hand, as slopes over fits of 8 and 40 steps). Its cost is one more copy
of the train state while a fit runs, made once a fit, and the host's
passing it to every call.

`holds` says where the trainer uses it: ``nan_policy="raise"`` on a TPU,
with one step a call, no dynamic loss scale, the state on the devices and
a gradient of at least `MIN_GRADIENT_BYTES` on each (the gated guard
elsewhere: XLA:CPU updates in place under a `lax.cond`, and a small
gradient costs the gated guard less than the held step's second state
costs the host). The run's spare travels in its `Run`; `Run.settled`
(``_state/_run.py``: it reads only the run's own flags) resolves it (the
state from before a bad last step) wherever the run is handed out whole.
"""

import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..._state._sums import FLAGS, EpochSums
from ...strategies._placement import HOST_MEMORY
from ._layout import StateLayout, leaf_names
from ._step_parts import StepParts, StepPlan, TrainInputs


# Whether the trainer holds the state instead of gating the update: "auto"
# (on a TPU, for a big enough gradient), or forced (tests run the held guard
# on a CPU).
HOLD: bool | Literal["auto"] = "auto"

# The least gradient (bytes on a device) "auto" holds the state for. The
# gated guard costs a write and a read of the gradient (41 µs for 16 MiB at
# a v5e's 819 GB/s); the held step, the state's buffers passed twice: on
# the v5e the MLPs 16-16-4 (batch 64) and 784-256-128-10 (batch 256) ran at
# 0.608 and 0.628 of a hand-written loop held, 0.655 and 0.687 gated, ~30 µs
# a step; the MLP 1024-4096×3-10 (152 MB) at 0.996 held, 0.942 gated.
MIN_GRADIENT_BYTES = 16 * 2**20

_BAD = FLAGS.index("nonfinite_step")
_SKIPPED = FLAGS.index("skipped")


def holds(parts: StepParts, layout: StateLayout, steps_per_call: int) -> bool:
    """Whether a fit's single-step calls use the held guard."""
    shardings = layout.shardings
    if HOLD == "auto":
        on = (
            jax.default_backend() == "tpu"
            and _gradient_bytes(layout) >= MIN_GRADIENT_BYTES
        )
    else:
        on = HOLD
    return (
        on
        and parts.nan_policy == "raise"
        and parts.precision.loss_scale != "dynamic"
        and steps_per_call == 1
        and not any(getattr(s, "memory_kind", None) == HOST_MEMORY for s in shardings)
    )


def _gradient_bytes(layout: StateLayout) -> int:
    """The bytes of a gradient of the state's model on one device (as its
    parameters are laid out)."""
    names = leaf_names(layout.treedef)
    pairs = zip(names, layout.structs, layout.shardings, strict=True)
    return sum(
        math.prod(sharding.shard_shape(struct.shape)) * struct.dtype.itemsize
        for name, struct, sharding in pairs
        if name.startswith("state.model") and jnp.issubdtype(struct.dtype, jnp.inexact)
    )


def held_train_step(
    train_step: Callable[[TrainInputs], tuple[list[jax.Array], EpochSums, jax.Array]],
    plan: StepPlan,
    inputs: TrainInputs,
    spare: list[jax.Array],
) -> tuple[list[jax.Array], EpochSums, Float[Array, " reported"]]:
    """One update of the state's leaves in `inputs` (the train step's
    outputs), unless an earlier step's gradient was not finite: then the
    state from before that step — `spare` where the leaves are that step's
    own update, else the leaves (already held) — the epoch's sums unchanged
    and NaN for the step's sums (the step is counted as skipped)."""
    run = lambda: train_step(inputs)  # noqa: E731
    reported = jax.eval_shape(run)[2]
    leaves, epoch_sums = inputs.leaves, inputs.epoch_sums

    def frozen() -> tuple[list[jax.Array], EpochSums, jax.Array]:
        step = plan.layout.unflatten(leaves).step  # the update's: bad + 1
        # Selected element by element: returned as they are (a `lax.cond`),
        # `leaves` would be copied on every step, held or not (XLA may not
        # return an argument it was not given to overwrite).
        updated = step > bad
        before = [jnp.where(updated, s, x) for s, x in zip(spare, leaves, strict=True)]
        flags = epoch_sums.flags.at[_SKIPPED].add(1)
        nan = jnp.full(reported.shape, jnp.nan, reported.dtype)
        return before, EpochSums(epoch_sums.sums, flags), nan

    bad = epoch_sums.flags[_BAD]
    return jax.lax.cond(bad >= 0, frozen, run)


def spare_for(
    shardings: list[jax.sharding.Sharding],
) -> Callable[[list[jax.Array]], list[jax.Array]]:
    """What makes a first spare for a state laid out as `shardings`: copies
    of its leaves, laid out alike (the next call donates them), in one call
    (a copy a leaf cost the host a dispatch each: 1.1 ms a fit for the
    tiny MLP's 16 leaves on a CPU).

    Copies: a jit returning its arguments as they are would hand back the
    same arrays, and the call donating them would delete the state."""
    copies = lambda leaves: [jnp.copy(x) for x in leaves]  # noqa: E731
    return jax.jit(copies, out_shardings=shardings)
