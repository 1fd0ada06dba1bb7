"""`steps_per_call=k`: k steps in one compiled call give the same run as one
step per call, for every strategy, with every step still reported."""

import jax
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import STRATEGIES, StopAt, make_data, make_model, max_abs_diff, sqrt_loss
from phalanx._typing import HostMetrics


K = 4


class Record(px.Callback):
    """Every step's number, metrics and `last_in_call`."""

    def __init__(self):
        self.steps: list[tuple[int, HostMetrics, bool]] = []

    @override
    def on_step_end(self, info: px.StepInfo) -> None:
        self.steps.append((info.step, info.metrics, info.last_in_call))


def loader(batch: int = 16) -> px.data.ArrayLoader:
    # 7 batches an epoch (the last one of 4 examples, padded): not a multiple of K.
    return px.data.ArrayLoader(make_data(100), batch, seed=0)


def trained(strategy: str, k: int, **kw) -> tuple[px.DataParallelTrainer, list]:
    record = Record()
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=STRATEGIES[strategy](),
        callbacks=[record],
        steps_per_call=k,
        **kw,
    )
    trainer.fit(loader(), epochs=2)  # 2 calls of K and 3 single steps an epoch
    trainer.fit(loader(), steps=6)  # a call of K and 2 single steps
    return trainer, record.steps


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_same_run_as_one_step_per_call(strategy):
    one, one_steps = trained(strategy, 1)
    many, many_steps = trained(strategy, K)
    assert max_abs_diff(many.model, one.model) <= 1e-6
    for name in ("loss", "accuracy"):
        assert many.history[name] == pytest.approx(one.history[name], rel=1e-6)
    assert [s for s, _, _ in many_steps] == list(range(1, 21))
    for (_, a, _), (_, b, _) in zip(many_steps, one_steps, strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert [last for _, _, last in one_steps] == [True] * 20
    # A call of K, then the epoch's last 3 steps, one by one, reported together.
    call, rest = [False] * (K - 1) + [True], [False, False, True]
    lasts = [last for _, _, last in many_steps]
    assert lasts == call + rest + call + rest + call + [False, True]
    assert int(many.state.step) == 20


def sharding_trainer(k: int = 1) -> px.DataParallelTrainer:
    return px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(8),
        steps_per_call=k,
    )


@pytest.mark.parametrize("where", ["host, weighted", "on the devices"])
def test_sample_weights_and_device_batches(where):
    x, y = make_data(96)
    w = np.random.default_rng(1).uniform(0.5, 2, 96).astype(np.float32)
    data = [(x[i : i + 16], y[i : i + 16], w[i : i + 16]) for i in range(0, 96, 16)]
    if where == "on the devices":  # stacked there (no sample weights: host only)
        data = jax.device_put(
            [b[:2] for b in data], px.ShardingStrategy(8).batch_sharding
        )
    one, many = sharding_trainer(), sharding_trainer(3)
    one.fit(data, epochs=2)
    many.fit(data, epochs=2)
    assert max_abs_diff(many.model, one.model) <= 1e-6
    assert many.history["loss"] == pytest.approx(one.history["loss"], rel=1e-6)


def test_a_call_is_compiled_once_and_the_rest_one_step_at_a_time():
    traces = []

    class Counted(px.DataParallelTrainer):
        @override
        def loss(self, model, outputs, targets):
            traces.append(outputs.shape)  # at trace time only
            return super().loss(model, outputs, targets)

    trainer = Counted(
        make_model(),
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(8),
        steps_per_call=K,
    )
    trainer.fit(loader(), epochs=1)
    # The first batch validated, then a call of K steps and a single step,
    # each traced once: the last, partial call costs one more compile only.
    assert len(traces) == 3
    trainer.fit(loader(), epochs=3)
    trainer.fit(loader(), steps=5)
    assert len(traces) == 3


def nan_batches():
    x, y = make_data(16 * 8)
    good = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 128, 16)]
    bad = (good[5][0], np.full(16, -1, np.int32))
    return good, [*good[:5], bad, *good[6:]]  # step 5 (from 0) is bad


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_bad_step_inside_a_call(policy):
    good, data = nan_batches()

    def trainer(k):
        return px.DataParallelTrainer(
            make_model(),
            optax.adam(1e-2),
            loss=sqrt_loss,
            strategy=px.ShardingStrategy(8),
            nan_policy=policy,
            steps_per_call=k,
        )

    run = trainer(K)
    if policy == "raise":
        clean = trainer(1)
        clean.fit(good[:5], epochs=1)
        with pytest.raises(FloatingPointError, match="at step 5"):
            run.fit(data, epochs=1)
        # The state is from before the bad step, in the middle of the call.
        assert max_abs_diff(run.model, clean.model) == 0
        assert int(run.state.step) == 5 and run.progress.step == 5
    else:
        clean = trainer(1)
        clean.fit(data, epochs=1)
        run.fit(data, epochs=1)
        assert run.history[0]["skipped_steps"] == 1
        assert max_abs_diff(run.model, clean.model) <= 1e-6


def test_stop_and_checkpoints_act_where_a_call_ends(tmp_path):
    straight = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=px.PmapStrategy(8), steps_per_call=K
    )
    straight.fit(loader(), epochs=3)
    checkpoint = px.callbacks.Checkpoint(tmp_path, every_n_steps=3, every_n_epochs=None)
    first = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=px.PmapStrategy(8),
        steps_per_call=K,
        callbacks=[checkpoint, StopAt(10)],
    )
    first.fit(loader(), epochs=3)
    # Steps 3, 6 and 9 fell inside calls ending at 4, 7 (the epoch's end) and 11.
    assert first.progress.step == 11
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [
        4,
        7,
        11,
    ]
    second = px.DataParallelTrainer(
        make_model(seed=1),
        optax.adam(1e-2),
        strategy=px.PmapStrategy(8),
        steps_per_call=K,
        callbacks=[px.callbacks.Checkpoint(tmp_path, every_n_epochs=None)],
    )
    second.fit(loader(), epochs=3, resume="latest")
    assert max_abs_diff(second.model, straight.model) == 0
    assert second.history["loss"] == straight.history["loss"]


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_steps_per_call(value):
    with pytest.raises(ValueError, match="steps_per_call"):
        px.DataParallelTrainer(make_model(), optax.adam(1e-2), steps_per_call=value)
