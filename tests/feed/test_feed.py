"""Batches prepared ahead on a background thread: the same training as
preparing each on the main thread, nothing lost or skipped when a fit stops
mid-epoch, errors raised at their batch's turn, generators not read ahead."""

import os
import sys
import threading
from collections.abc import Callable

import jax
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model, max_abs_diff


def trainer(prefetch: int = 2, **kwargs) -> px.DataParallelTrainer:
    return px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(4),
        prefetch=prefetch,
        **kwargs,
    )


def loader() -> px.data.ArrayLoader:
    x, y = make_data(100, seed=2)
    return px.data.ArrayLoader((x, y), 16, seed=0)  # 7 batches per epoch


def watched(
    strategy: px.Strategy, what: Callable[[], object] = threading.current_thread
) -> tuple[px.DataParallelTrainer, list[object]]:
    """A trainer that notes `what()` as it prepares each batch, and the notes."""
    seen = []

    class Watched(px.DataParallelTrainer):
        @override
        def split_batch(self, batch):
            seen.append(what())
            return super().split_batch(batch)

    return Watched(make_model(), optax.adam(1e-2), strategy=strategy), seen


def test_stopping_mid_epoch_rewinds_the_loader_to_the_last_batch_trained():
    data = loader()
    ahead = trainer(prefetch=3)
    ahead.fit(data, steps=3)
    # Three batches trained; up to three more were read ahead and given back.
    assert data.state_dict() == {"epoch": 0, "position": 3, "batch_size": 16}
    ahead.fit(data, steps=6)  # the rest of epoch 0, then two of epoch 1

    inline_data = loader()
    inline = trainer(prefetch=0)
    inline.fit(inline_data, steps=9)
    assert data.state_dict() == inline_data.state_dict()
    assert data.state_dict() == {"epoch": 1, "position": 2, "batch_size": 16}
    assert max_abs_diff(ahead.model, inline.model) == 0


def test_a_step_hook_sees_the_batches_trained_not_those_read_ahead():
    positions = []

    class Where(px.Callback):
        @override
        def on_step_end(self, info):
            positions.append(info.snapshot().data)

    data = loader()
    trainer(callbacks=[Where()]).fit(data, steps=4)
    assert positions == [
        {"epoch": 0, "position": p, "batch_size": 16} for p in (1, 2, 3, 4)
    ]


def test_a_bad_batch_read_ahead_raises_at_its_turn():
    x, y = make_data(64)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    bad = batches[2][0].copy()
    bad[5, 1] = np.nan
    batches[2] = (bad, batches[2][1])
    run = trainer()
    with pytest.raises(ValueError, match="batch 2 of epoch 0"):
        run.fit(batches)
    assert run.progress.step == 2  # the two batches before it were trained on


def test_an_error_in_a_hook_reaches_the_caller():
    class Broken(px.DataParallelTrainer):
        @override
        def split_batch(self, batch):
            if batch[0][0, 0] == 99:
                raise KeyError("no such field")
            return super().split_batch(batch)

    x, y = make_data(48)
    x[32, 0] = 99
    run = Broken(make_model(), optax.adam(1e-2), strategy=px.ShardingStrategy(4))
    with pytest.raises(KeyError, match="no such field"):
        run.fit([(x[i : i + 16], y[i : i + 16]) for i in range(0, 48, 16)])
    assert run.progress.step == 2


def test_a_generator_is_not_read_ahead():
    x, y = make_data(160)
    taken = []

    def batches():
        for i in range(0, 160, 16):
            taken.append(i)
            yield x[i : i + 16], y[i : i + 16]

    source = batches()
    trainer().fit(source, steps=3)
    assert taken == [0, 16, 32]
    assert next(source)[0][0, 0] == x[48, 0]  # the next batch is still there


@pytest.mark.skipif(sys.platform != "linux", reason="SCHED_IDLE is Linux's")
def test_batches_are_prepared_at_idle_priority():
    run, policies = watched(px.ShardingStrategy(4), lambda: os.sched_getscheduler(0))
    run.fit(loader(), epochs=2)
    # Each pass's first batch on the calling thread, the rest on the
    # background thread.
    assert policies == 2 * ([os.SCHED_OTHER] + [os.SCHED_IDLE] * 6)


def test_batches_already_on_devices_are_not_read_ahead():
    run, threads = watched(px.ShardingStrategy(4))
    x, y = make_data(64)
    placed = jax.device_put(
        [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)],
        run.strategy.batch_sharding,
    )
    run.fit(placed, epochs=2)
    assert threads == [threading.main_thread()] * 8


def test_evaluation_reads_ahead_too_and_gives_the_same_numbers():
    ahead, inline = trainer(prefetch=2), trainer(prefetch=0)
    results = [t.evaluate(loader()) for t in (ahead, inline)]
    assert results[0] == results[1]
    x, y = make_data(64)
    x[40, 0] = np.inf
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    with pytest.raises(ValueError, match="batch 2 leaf .* non-finite .* example 8"):
        ahead.evaluate(batches)


def test_by_default_one_cpu_device_prepares_on_the_calling_thread():
    # XLA spreads one CPU device's step over every core: no idle core for
    # the thread. Several devices (and explicit values) read ahead.
    def made(strategy, **kwargs):
        return px.DataParallelTrainer(
            make_model(), optax.adam(1e-2), strategy=strategy, **kwargs
        )

    assert made(px.ShardingStrategy(1)).prefetch == 0
    assert made(px.AccumulatingStrategy(px.PmapStrategy(1), 2)).prefetch == 0
    assert made(px.ShardingStrategy(4)).prefetch == 2
    assert made(px.ShardingStrategy(1), prefetch=3).prefetch == 3

    run, threads = watched(px.ShardingStrategy(1))
    run.fit(loader())
    assert threads == [threading.main_thread()] * 7
