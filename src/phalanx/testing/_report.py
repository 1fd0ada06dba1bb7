"""What `assert_equivalent` found for one set-up: `Equivalence`, a value."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Equivalence:
    """How one set-up compared with one device on the full batch.

    Each is the largest over the steps, each step taken from the same state
    as the reference. The first three are relative to each value's scale (its
    largest magnitude, or a tenth of the largest of its kind where that
    is more: rounding in the rest reaches a part that small).

    Attributes:
        gradient: the largest difference of a leaf of the reduced gradient.
        values: the largest difference of the loss or a metric.
        model_state: the largest difference of the model state after a
            step (0 without model state).
        parameters: the largest absolute difference of a parameter a step
            leads to.
        split: the parameter leaves the set-up splits over its devices (a
            fully sharded one); empty where every leaf is replicated.
        amplified: the parameter leaves whose update differed by more than
            `atol`, within what the optimizer makes of rounding: entries of
            their gradient are zero up to rounding (a key bias under softmax,
            a bias before BatchNorm, a unit that never fires), and an
            optimizer that normalises the gradient (adam) turns that rounding
            into steps of the learning rate's size. Allowed for: not the
            strategy's doing.
    """

    gradient: float
    values: float
    model_state: float
    parameters: float
    split: tuple[str, ...] = ()
    amplified: tuple[str, ...] = ()

    def __repr__(self) -> str:
        parts = [
            f"gradient={self.gradient:.2g}",
            f"values={self.values:.2g}",
            f"model_state={self.model_state:.2g}",
            f"parameters={self.parameters:.2g}",
        ]
        if self.split:
            parts.append(f"split={len(self.split)} leaves")
        if self.amplified:
            parts.append(f"amplified={list(self.amplified)}")
        return f"Equivalence({', '.join(parts)})"
