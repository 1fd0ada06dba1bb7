"""Parameter groups: several optimizers in one step, each training its own
parameters, on its own loss or on the shared one.

The trainer's ``optimizer`` may be a mapping of group names to optax
transformations, and its `param_groups` hook names each parameter's group.
The groups' transformations become one `optax.multi_transform`, so the
optimizer state, checkpoints and shardings stay one pytree; the step takes
each group's gradient of that group's loss (the loss returning one
per-example loss per group) with the other groups' parameters held fixed,
all in one backward pass over a batch of cotangents, and reduces the
gradients of every group at once.
"""

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import PyTree

from ..._checks._hooks import HookTypeError, HookValueError, returned


class Groups(NamedTuple):
    """A trainer's parameter groups.

    Attributes:
        names: the groups, in the optimizer mapping's order.
        index: the parameters (the model's floating-point arrays, its other
            leaves None) with the index in `names` of each one's group in
            place of its array.
        optimizer: the groups' transformations as one.
    """

    names: tuple[str, ...]
    index: PyTree[int]
    optimizer: optax.GradientTransformation


def group_labels(groups: Groups) -> list[tuple[str, str]]:
    """Each parameter's path (``model.head.weight``) and the group that
    trains it, in the model's order."""
    return [
        (f"model{jax.tree_util.keystr(path)}", groups.names[index])
        for path, index in jax.tree_util.tree_leaves_with_path(groups.index)
    ]


def loss_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """The metrics each group's own loss is logged as."""
    return tuple(f"{name}_loss" for name in names)


def _is_label(x: Any) -> bool:
    return isinstance(x, str)


def grouped(
    optimizers: Mapping[str, optax.GradientTransformation],
    labels: Any,
    model: eqx.Module,
) -> Groups:
    """The groups of a trainer whose optimizer is `optimizers`, given what
    its `param_groups` hook returned for `model` (`labels`: the model with
    each group's name in place of the subtree it trains).

    Raises:
        HookTypeError, HookValueError: `labels` is not a model-shaped tree
            of the optimizers' group names, or leaves a parameter out.
    """
    names = tuple(optimizers)
    params = eqx.filter(model, eqx.is_inexact_array)
    try:
        full = jax.tree.map(
            lambda label, sub: jax.tree.map(lambda _: label, sub),
            labels,
            params,
            is_leaf=_is_label,
        )
    except (TypeError, ValueError) as error:
        raise HookTypeError(
            f"param_groups returned {returned(labels)}, which is not the model "
            "with a group's name in place of each part it trains; return e.g. "
            "eqx.tree_at(lambda m: (m.generator, m.discriminator), model, "
            "('generator', 'discriminator'))"
        ) from error
    used = set()
    for path, label in jax.tree_util.tree_leaves_with_path(full):
        where = f"model{jax.tree_util.keystr(path)}"
        if not _is_label(label):
            raise HookValueError(
                f"param_groups left the parameter {where} in no group; name a "
                f"group for every parameter (the groups: {list(names)})"
            )
        if label not in names:
            raise HookValueError(
                f"param_groups put {where} in a group {label!r}, which the "
                f"optimizer mapping lacks (its groups: {list(names)}); name one "
                "of those, or add an optimizer for it"
            )
        used.add(label)
    idle = [name for name in names if name not in used]
    if idle:
        raise HookValueError(
            f"param_groups gave group {idle[0]!r} no parameters; put some in it, "
            "or drop its optimizer"
        )
    return Groups(
        names,
        jax.tree.map(names.index, full),
        # Labels in a function: a model is callable, and optax would call it.
        optax.multi_transform(
            {name: optimizers[name] for name in names}, lambda _: full
        ),
    )


def check_group_losses(
    losses: Mapping[str, Any], groups: Groups | None
) -> tuple[tuple[str, str], ...]:
    """At trace time: a loss by group must give one for each group; each
    group's name, and the name its loss is logged under (in the optimizer
    mapping's order)."""
    if groups is None:
        raise HookTypeError(
            f"loss returned a dict of {sorted(losses)}: a loss per parameter "
            "group, but the optimizer is one transformation; pass optimizer="
            "{group: transformation} and override param_groups to say which "
            "parameters each group trains (or return one per-example loss)"
        )
    if set(losses) != set(groups.names):
        raise HookValueError(
            f"loss returned losses for {sorted(losses)}, but the optimizer's "
            f"groups are {list(groups.names)}; return one per-example loss for "
            "each group, keyed by its name"
        )
    return tuple(zip(groups.names, loss_names(groups.names), strict=True))


def own_loss(sums: Mapping[str, Any], groups: Groups | None) -> jax.Array:
    """What a step differentiates: the loss; where each group has its own,
    their vector, in the groups' order."""
    if groups is None or loss_names(groups.names)[0] not in sums:
        return sums["loss"]
    return jnp.stack([sums[name] for name in loss_names(groups.names)])


def group_gradients(
    objective: Callable[[Any], tuple[jax.Array, Any]], params: Any, groups: Groups
) -> tuple[Any, Any]:
    """Each group's gradient of its own loss (`objective` returning a vector
    of them, in the groups' order) with the others' parameters held fixed,
    from one backward pass over a batch of cotangents; or, for one shared
    loss (a scalar), the gradient of it. Returns the gradient and
    `objective`'s aux."""
    loss, backward, aux = jax.vjp(objective, params, has_aux=True)
    if loss.ndim == 0:
        (grads,) = backward(jnp.ones_like(loss))
        return grads, aux
    (each,) = jax.vmap(backward)(jnp.eye(len(groups.names), dtype=loss.dtype))
    return jax.tree.map(lambda g, i: g[i], each, groups.index), aux
