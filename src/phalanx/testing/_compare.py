"""How `assert_equivalent` compares a set-up's step with one device's from the
same state: the gradient, loss, metrics and model state relative to their
scale, and the parameters the step leads to within what the optimizer makes
of rounding. The messages name the set-up, the step, the value and the usual
causes."""

from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np

from .._engine.program._programs import StepValues


# A part far smaller than the largest of its kind is measured against a
# tenth of that largest: rounding in the rest reaches it. A gradient leaf that
# is zero in exact arithmetic (a key bias under softmax, a bias before
# BatchNorm or under centred logits) holds nothing but rounding noise, seen as
# large as 4e-7 of the largest leaf's scale (an MLP's output bias under
# logits centred over the batch).
FLOOR = 0.1

HINT = """\
The usual causes:
- a loss averaged per device instead of per example: return one value per
  example (a mean over the batch, or a division by the local batch size, is a
  mean of means across devices); phalanx weights and averages them once;
- a collective (psum, pmean, all_gather) in the loss under ShardingStrategy,
  where no device axis is bound: collectives need a per-device strategy
  (PmapStrategy, FullyShardedStrategy), so pass strategies= without it;
- a collective where none belongs (psum of the per-example losses: phalanx
  already sums over the devices once) or over the wrong axis: use
  self.strategy.axis_name;
- a loss that depends on the per-device batch size (x.shape[0], a mean over
  the local batch inside a per-example value);
- BatchNorm statistics per device (axis_name="batch" under a per-device
  strategy): use axis_name=("batch", strategy.axis_name) for global ones;
- a batch not divisible by a set-up's devices x microbatches: the trainer pads
  it with zero-weight rows, which collectives and batch statistics see."""

UPDATE_HINT = """\
The step's gradient, loss and metrics matched one device's from the same state,
so the difference is in how the update is applied: the optimizer and its state
under the set-up's layout."""

Leaves = list[tuple[str, np.ndarray]]


class Allowance(NamedTuple):
    """What a parameter leaf's update may differ by, beyond `atol`.

    Attributes:
        total: a few times the gap between the optimizer's updates of the
            two gradients, plus twice the update of every entry whose
            gradient is zero up to rounding (rounding is all that update is
            made of, in each run's own direction).
        rounding: whether some entries' gradient is zero up to rounding and
            the optimizer moves them anyway.
    """

    total: float
    rounding: bool


def named_leaves(tree: Any, prefix: str = "") -> Leaves:
    """The floating-point leaves of `tree` on the host, by path."""
    arrays = eqx.filter(tree, eqx.is_inexact_array)
    leaves = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        name = jax.tree_util.keystr(path).replace("<flat index ", "").replace(">", "")
        leaves.append(((prefix + name).removeprefix("."), np.asarray(leaf)))
    return leaves


def gaps(want: Leaves, have: Leaves) -> list[tuple[str, float, float]]:
    """Each leaf's path, largest difference and scale (its largest magnitude,
    at least `FLOOR` times the largest of them all)."""
    if [path for path, _ in want] != [path for path, _ in have]:
        raise ValueError(
            "make_trainer built a model of another structure than the "
            "reference's; build the same model on every call"
        )
    scales = [float(np.max(np.abs(w), initial=0.0)) for _, w in want]
    floor = FLOOR * max(scales, default=0.0)
    found = []
    for (path, w), (_, h), scale in zip(want, have, scales, strict=True):
        diff = float(np.max(np.abs(w - h), initial=0.0))
        found.append((path, diff if np.isfinite(diff) else np.inf, max(scale, floor)))
    return found


def relative(diff: float, scale: float) -> float:
    """`diff` as a fraction of `scale` (0 / 0 is 0)."""
    if diff == 0:
        return 0.0
    return diff / scale if scale > 0 else np.inf


def zero_levels(grads: Any, rtol: float) -> Any:
    """Per leaf of `grads`, the magnitude below which an entry is zero up to
    rounding: the tolerance its comparison allows (a tree like `grads`)."""
    leaves = named_leaves(grads)
    zeros = [(path, np.zeros_like(leaf)) for path, leaf in leaves]
    levels = [rtol * scale for _, _, scale in gaps(leaves, zeros)]
    arrays = eqx.filter(grads, eqx.is_inexact_array)
    return jax.tree.unflatten(jax.tree.structure(arrays), levels)


def check_step(
    name: str, step: int, want: StepValues, have: StepValues, rtol: float
) -> tuple[float, float, float]:
    """Compare a set-up's step with the reference's from the same state.

    Returns:
        The largest relative differences of the gradient, of the loss and
        metrics, and of the model state.

    Raises:
        AssertionError: one differs by more than `rtol` of its scale.
    """
    at = f"{name}: at step {step}, from the same state as one device on the full batch,"
    values = [(k, np.asarray(v)) for k, v in want.metrics.items()]
    found = gaps(values, [(k, np.asarray(have.metrics[k])) for k, _ in values])
    for (key, diff, scale), (_, value) in zip(found, values, strict=True):
        if not relative(diff, scale) <= rtol:
            what = "the loss" if key == "loss" else f"the metric {key!r}"
            raise AssertionError(
                f"{at} {what} is {have.metrics[key]:.6g} where one device "
                f"computes {float(value):.6g} (difference {diff:.3g}, "
                f"{relative(diff, scale):.3g} of its scale; rtol={rtol:g}).\n{HINT}"
            )
    worst_values = max((relative(d, s) for _, d, s in found), default=0.0)
    worst = []
    for kind, prefix, w, h in (
        ("the gradient of", "", want.grads, have.grads),
        (
            "the model state",
            "model_state",
            want.state.model_state,
            have.state.model_state,
        ),
    ):
        found = gaps(named_leaves(w, prefix), named_leaves(h, prefix))
        for path, diff, scale in found:
            if not relative(diff, scale) <= rtol:
                raise AssertionError(
                    f"{at} {kind} {path} differs by {diff:.3g} (max abs), "
                    f"{relative(diff, scale):.3g} of its scale {scale:.3g} "
                    f"(rtol={rtol:g}).\n{HINT}"
                )
        worst.append(max((relative(d, s) for _, d, s in found), default=0.0))
    return worst[0], worst_values, worst[1]


def check_update(
    name: str,
    step: int,
    atol: float,
    found: list[tuple[str, float, float]],
    allowed: dict[str, Allowance],
) -> tuple[float, set[str]]:
    """Compare the parameters a set-up's step leads to with the reference's,
    from the same state.

    Args:
        found: each parameter leaf's path and largest difference (`gaps`).
        allowed: per leaf, what the optimizer makes of the rounding in this
            step's gradient, allowed on top of `atol`.

    Returns:
        The largest difference of a parameter, and the leaves that differ by
        more than `atol` (within what the optimizer makes of rounding).

    Raises:
        AssertionError: a leaf differs by more than `atol` and its allowance.
    """
    beyond = set()
    for path, diff, _ in found:
        allowance = allowed.get(path, Allowance(0.0, False))
        if diff <= atol:
            continue
        if diff <= atol + allowance.total:
            beyond.add(path)
            continue
        note = ""
        if allowance.rounding:
            note = (
                " Entries of its gradient are zero up to rounding (e.g. a key "
                "bias under softmax, a bias before BatchNorm, a unit that never "
                "fires), and the optimizer turns that rounding into updates: "
                "compare with optax.sgd, or raise atol."
            )
        raise AssertionError(
            f"{name}: at step {step}, from the same state as one device on the "
            f"full batch, the update leaves parameter {path} {diff:.3g} (max "
            f"abs) away from one device's, more than atol={atol:g} plus "
            f"{allowance.total:.3g}, what the optimizer makes of the rounding "
            f"in the step's gradient.{note}\n{UPDATE_HINT}"
        )
    return max((diff for _, diff, _ in found), default=0.0), beyond
