"""The errors a run raises past the batch checks, and their messages.

Data that yielded no batches, a batch whose examples all weigh 0 (it has no
gradient), and the first non-finite gradient under ``nan_policy="raise"``.
The engine builds these errors; nothing here touches a device.
"""

from typing import Any

import equinox as eqx
import jax


def empty_data_message(name: str, epoch: int | None = None) -> str:
    """The error for an iterable that yielded no batches."""
    where = "" if epoch is None else f" in epoch {epoch}"
    return (
        f"{name}: yielded no batches{where}; pass a non-empty re-iterable such as a "
        "list of (x, y) batches (a generator is used up after one pass: wrap it in "
        "a class whose __iter__ makes a new one)"
    )


def zero_weight_message(where: str) -> str:
    """The error for a batch to train on whose examples all weigh 0."""
    return (
        f"data: {where} has total sample weight 0 (every example's sample_weight "
        "is 0, or the batch is all padding), so it has no gradient: a step "
        "divides by the batch's total weight. Drop such batches, or give some "
        "examples a weight > 0"
    )


# The leaf a non-finite step records when its batch weighed nothing at all.
ZERO_WEIGHT = -2


def nonfinite_error(
    step: int, leaf: int, model: Any
) -> FloatingPointError | ValueError:
    """The error for the first non-finite gradient under nan_policy="raise"
    (a ValueError where the batch's total weight was 0: the data's fault)."""
    if leaf == ZERO_WEIGHT:
        return ValueError(zero_weight_message(f"the batch of step {step}"))
    paths = jax.tree_util.tree_flatten_with_path(
        eqx.filter(model, eqx.is_inexact_array)
    )[0]
    name = "model" + jax.tree_util.keystr(paths[leaf][0])
    return FloatingPointError(
        f"non-finite gradient (NaN or inf) in {name} at step {step} "
        "(nan_policy='raise'); the state is kept as it was before that step. "
        "Lower the learning rate, clip gradients (optax.clip_by_global_norm), "
        "check the data, or pass nan_policy='skip' to skip such updates"
    )
