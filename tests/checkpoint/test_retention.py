"""Which checkpoints `Checkpoint(monitor=)` keeps, and that its unranked saves
(mid-epoch, or epoch ends between evaluations) print nothing of orbax's."""

import dataclasses
import datetime
import logging
import os
from typing import Any

import optax
import orbax.checkpoint as ocp
import pytest

import phalanx as px
from helpers import make_data, make_model
from phalanx.checkpoint._retention import metric_fn, retention


@dataclasses.dataclass
class Info:  # what orbax tells a preservation policy of one checkpoint
    step: int
    metrics: dict[str, Any] | None
    time: datetime.datetime = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.UTC)
    )


def kept(policy, *metrics) -> list[int]:
    """The steps (1, 2, ...) `policy` keeps of checkpoints with `metrics`."""
    infos = [Info(step, m) for step, m in enumerate(metrics, 1)]
    flags = policy.should_preserve(
        infos, context=ocp.checkpoint_managers.PreservationContext()
    )
    return [info.step for info, keep in zip(infos, flags, strict=True) if keep]


@pytest.mark.parametrize("unranked", [{}, None])  # None: an earlier version's
def test_unranked_saves_are_kept_only_while_newest(unranked):
    policy = retention(2, "eval_loss", "min")
    loss = lambda value: {"eval_loss": value}  # noqa: E731
    # The best two ranked (steps 2 and 4) and the newest of any kind (5).
    assert kept(policy, unranked, loss(0.5), unranked, loss(0.3), unranked) == [2, 4, 5]
    assert kept(policy, loss(0.5), unranked, loss(0.9), loss(0.1)) == [1, 4]
    # However few ranked saves there are yet, an unranked one that is not the
    # newest does not fill a free place.
    assert kept(policy, unranked, loss(0.5), unranked) == [2, 3]
    assert kept(retention(2, "eval_acc", "max"), loss(1), {"eval_acc": 0.2}) == [2]
    assert kept(retention(2, None, "min"), None, None, None) == [2, 3]
    # orbax's own sort (its `best_step`) never picks an unranked save.
    assert metric_fn("eval_loss", "min")({}) == float("inf")
    assert metric_fn("eval_acc", "max")(None) == float("-inf")
    assert metric_fn("eval_loss", "max")({"eval_loss": 2}) == 2.0


@pytest.mark.slow
def test_a_monitor_with_unranked_saves_prints_nothing(tmp_path, caplog):
    # Saves every 3 steps, ranked only at epoch ends (7 steps an epoch): orbax
    # logged "Requested `tracked_metric`; did not provide metrics." at each
    # save that no metric ranked.
    x, y = make_data(100, seed=3)
    checkpoint = px.callbacks.Checkpoint(
        tmp_path, every_n_steps=3, keep=1, monitor="eval_loss"
    )
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[checkpoint], progress=False
    )
    with caplog.at_level(logging.DEBUG):
        trainer.fit(
            px.data.ArrayLoader((x, y), 16, seed=1),
            epochs=2,
            eval_data=[make_data(32, seed=4)],
        )
    orbax = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not orbax, orbax
    losses = [epoch["eval_loss"] for epoch in trainer.history.epochs]
    best = 7 * (losses.index(min(losses)) + 1)
    steps = sorted(int(p) for p in os.listdir(tmp_path) if p.isdigit())
    assert steps == sorted({best, 14})
    with ocp.CheckpointManager(tmp_path) as manager:
        assert manager.metrics(best)["eval_loss"] == min(losses)
