"""Checks of class labels under ``loss="cross_entropy"``, and the messages
they raise.

The first batch's labels are checked to be integer class indices (not one-hot
or soft labels, not floats); while ``checks="on"``, each host batch's labels
are checked to lie in ``[0, num_classes)``. When the first step fails on
labels of more than one axis, `label_shape_hint` says why.
"""

from typing import Any

import numpy as np

from ..program._spec import Leaf


def check_class_labels(labels: Any) -> None:
    """Raise TypeError for labels ``loss="cross_entropy"`` cannot take:
    one-hot or soft labels (a value per class) named as such, and any other
    labels that are not integers."""
    if isinstance(labels, Leaf) and labels.ndim >= 2 and labels.dtype.kind in "bf":
        raise TypeError(one_hot_message(labels))
    if not isinstance(labels, Leaf) or labels.dtype.kind not in "iu":
        raise TypeError(
            "data: labels y have dtype "
            f"{getattr(labels, 'dtype', type(labels))}; loss='cross_entropy' "
            "needs integer class labels, e.g. y.astype(np.int32) (or use "
            "loss='mse' for regression)"
        )


def one_hot_message(labels: Leaf) -> str:
    """The error for one-hot or soft labels under ``loss="cross_entropy"``."""
    shape = tuple(labels.shape)
    return (
        f"data: labels y are {labels.dtype}{list(shape)}, one-hot or soft labels "
        "(a value per class), but loss='cross_entropy' takes integer class "
        f"indices, of shape {shape[:-1]}; pass y.argmax(-1) (e.g. "
        "px.data.ArrayLoader((x, y.argmax(-1)), batch_size=64)), or "
        "loss='categorical_cross_entropy' to train on these labels as they are"
    )


def label_shape_hint(labels: Any) -> str | None:
    """Why integer labels of more than one axis, on which the first batch
    failed under ``loss="cross_entropy"``, are the likely cause: one-hot
    labels, or one label per example in a trailing axis of 1 (None where
    neither is what they look like)."""
    if not isinstance(labels, Leaf) or labels.ndim < 2:
        return None
    shape = tuple(labels.shape)
    if shape[-1] == 1:
        return (
            f"data: labels y have shape {shape}, one class index per example in "
            "a trailing axis of 1, but loss='cross_entropy' takes them without "
            f"it, of shape {shape[:-1]}; pass y.reshape(-1) (or y[..., 0])"
        )
    values = np.asarray(labels)
    if ((values == 0) | (values == 1)).all() and (values.sum(-1) == 1).all():
        return one_hot_message(labels)
    return None


def check_labels(labels: np.ndarray, num_classes: int, where: str) -> None:
    """Raise if integer class labels fall outside ``[0, num_classes)``."""
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= num_classes:
        raise ValueError(
            f"data: {where} has labels from {low} to {high}, outside [0, "
            f"{num_classes}) for a model with {num_classes} outputs; labels must be "
            f"class indices 0..{num_classes - 1} (or give the model more outputs)"
        )
