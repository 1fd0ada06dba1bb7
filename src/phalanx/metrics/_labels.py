"""What the classification metrics read from a model's outputs and targets:
predicted and true labels, and each class's log-odds."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class MetricArgumentError(ValueError):
    """A `px.metrics` function was given arguments that do not fit: the
    hook that called it is at fault, not the batch."""


def check_classes(outputs: Array, num_classes: int | None, metric: str) -> int:
    """At trace time, after `true_labels` (the outputs have a batch axis):
    the number of classes of `outputs`, scores of `num_classes` classes (or,
    for two, one score per example), per example or (in axes before the
    last) per token; where `num_classes` is None, counted on the outputs
    (their class axis, or 2 for one score per example)."""
    shape = tuple(outputs.shape)
    if num_classes is None:
        if outputs.ndim == 1:
            return 2
        if shape[-1] >= 2:
            return int(shape[-1])
        raise MetricArgumentError(
            f"px.metrics.{metric}: outputs of shape {shape} hold one score "
            "per example, in an axis of 1: no classes to count for "
            "num_classes=None; pass outputs[:, 0] (shape (batch,): a binary "
            "task), or a score per class, of shape (batch, num_classes)"
        )
    if not isinstance(num_classes, int) or num_classes < 2:
        raise MetricArgumentError(
            f"px.metrics.{metric}: num_classes={num_classes!r}; pass the number "
            "of classes, an int >= 2 (2 for a binary task), or None to count "
            "them on the outputs"
        )
    if outputs.ndim == 1:
        if num_classes != 2:
            raise MetricArgumentError(
                f"px.metrics.{metric}: outputs of shape {shape} "
                f"(one score per example) with num_classes={num_classes}; one "
                "score is a binary task: pass num_classes=2, or outputs of shape "
                f"(batch, {num_classes})"
            )
    elif shape[-1] != num_classes:
        raise MetricArgumentError(
            f"px.metrics.{metric}: outputs of shape {shape}, but "
            f"num_classes={num_classes}; pass scores of shape (batch, "
            f"{num_classes}) (or (batch,) for a binary task), or the number of "
            "classes the outputs have (or None: counted on them)"
        )
    return num_classes


def true_labels(
    outputs: Array, targets: Array, metric: str
) -> Int[Array, " batch *tokens"]:
    """At trace time: the true class of each example, from its label or its
    one-hot (or soft) targets (their arg-max); or, for per-token targets
    (outputs of shape (batch, *tokens, classes), targets (batch, *tokens)
    or one-hot ones of the outputs' shape), of each token. Targets of
    another shape are refused, naming `metric` (who scores them)."""
    o, t = tuple(outputs.shape), tuple(targets.shape)
    if len(t) >= 2 and t == o:
        return jnp.argmax(targets, axis=-1)
    if (len(t) == 1 and len(o) <= 2 and t == o[:1]) or (len(t) >= 2 and t == o[:-1]):
        return targets.astype(jnp.int32)
    labels = o[:-1] if len(o) >= 2 else o
    each = "per token, negative ones left out" if len(o) >= 3 else "one per example"
    raise MetricArgumentError(
        f"{metric}: targets of shape {t} do not fit outputs of shape {o}; pass "
        f"class labels of shape {labels} ({each}) or one-hot targets of shape {o}"
    )


def predicted_labels(
    outputs: Array, *, from_logits: bool
) -> Int[Array, " batch *tokens"]:
    """The most likely class (of each example, or token); for one score per
    example, class 1 where it is above 0 (a logit) or 0.5 (a probability)."""
    if outputs.ndim == 1:
        return (outputs > (0.0 if from_logits else 0.5)).astype(jnp.int32)
    return jnp.argmax(outputs, axis=-1).astype(jnp.int32)


def log_odds(outputs: Array, *, from_logits: bool) -> Float[Array, "batch classes"]:
    """Each class's log-odds log(p / (1 - p)), computed without forming 1 - p
    (which rounds to 0 for a confident class); one score per example gives
    those of classes 0 and 1."""
    outputs = outputs.astype(jnp.float32)
    if outputs.ndim == 1:
        odds = outputs if from_logits else _logit(outputs)
        return jnp.stack([-odds, odds], axis=-1)
    if from_logits:
        log_p = jax.nn.log_softmax(outputs, axis=-1)
    else:
        log_p = jnp.log(outputs)
    # log(1 - p) = log(-expm1(log p)), accurate as p nears 1.
    return log_p - jnp.log(-jnp.expm1(log_p))


def _logit(p: Array) -> Array:
    return jnp.log(p) - jnp.log1p(-p)
