"""Invariant 3 (no recompilation, no host sync but at log points, long runs
finish) and the order in which callback hooks fire."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from typing_extensions import override

import phalanx as px
from helpers import STRATEGIES, count_host_waits, make_data, make_model, max_abs_diff


class CountingTrainer(px.DataParallelTrainer):
    """Counts how often the loss is traced (it runs only while tracing)."""

    traces = 0

    @override
    def loss(self, model, outputs, targets):
        type(self).traces += 1
        return super().loss(model, outputs, targets)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_no_recompilation_after_first_step(name):
    x, y = make_data(100)
    batches = [(x[:32], y[:32]), (x[32:64], y[32:64]), (x[64:96], y[64:96])]
    ragged = [*batches, (x[96:], y[96:])]  # padded to 32: same compiled shape
    trainer = CountingTrainer(
        make_model(), optax.adam(1e-2), strategy=STRATEGIES[name]()
    )
    CountingTrainer.traces = 0
    trainer.fit(batches[:1], steps=1)
    after_first = CountingTrainer.traces
    assert after_first > 0
    trainer.fit(ragged, epochs=3)
    trainer.fit(batches, steps=7)
    assert CountingTrainer.traces == after_first
    assert int(trainer.state.step) == 1 + 12 + 7


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_host_syncs_only_at_log_points(monkeypatch, name):
    x, y = make_data(32)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=STRATEGIES[name](), sync_every=8
    )
    trainer.fit([(x, y)], steps=2)  # compile outside the counted run
    fetches = count_host_waits(monkeypatch)
    # No implicit device-to-host transfer anywhere in the loop.
    with jax.transfer_guard_device_to_host("disallow"):
        trainer.fit([(x, y)] * 32, epochs=1)
    # 32 steps: at each multiple of 8 after the first, a wait for the step 8
    # before (the in-flight window), plus the epoch's log point.
    assert len(fetches) == 32 // 8 - 1 + 1


@pytest.mark.parametrize("name", ["sharding", "pmap"])
def test_batches_already_on_devices(name):
    # jax.Array batches (placed by the user, a ragged last one included) train
    # exactly as the same NumPy batches, without a copy back to the host.
    x, y = make_data(100)
    host = [(x[:32], y[:32]), (x[32:64], y[32:64]), (x[64:], y[64:])]
    trained = []
    for on_device in (False, True):
        trainer = px.DataParallelTrainer(
            make_model(), optax.adam(1e-2), strategy=STRATEGIES[name]()
        )
        split = trainer.strategy.batch_sharding
        assert isinstance(split, NamedSharding)
        data = [jax.device_put(b, split) for b in host[:2]] + [host[2]]
        devices = split.mesh.devices
        assert devices is not None
        data[2] = jax.device_put(host[2], devices.flat[0])  # 36 rows
        with jax.transfer_guard_device_to_host("disallow"):
            trainer.fit(data if on_device else host, epochs=2)
        trained.append(trainer)
    assert max_abs_diff(trained[0].model, trained[1].model) == 0
    assert trained[0].history.epochs == trained[1].history.epochs


@pytest.mark.slow
def test_two_thousand_steps_on_eight_devices():
    x, y = make_data(64)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-3), strategy=px.PmapStrategy(8)
    )
    trainer.fit([(x[:32], y[:32]), (x[32:], y[32:])], steps=2000)
    assert int(trainer.state.step) == 2000
    assert trainer.history[-1]["loss"] < trainer.history[0]["loss"]


class Recorder(px.Callback):
    def __init__(self):
        self.events: list[str] = []

    @override
    def on_fit_start(self, info):
        self.events.append("fit_start")

    @override
    def on_fit_end(self, info):
        self.events.append("fit_end")

    @override
    def on_epoch_start(self, info):
        self.events.append(f"epoch_start {info.epoch}")

    @override
    def on_epoch_end(self, info):
        self.events.append(f"epoch_end {info.epoch} {sorted(info.metrics)}")

    @override
    def on_step_end(self, info):
        self.events.append(f"step {info.step}")

    @override
    def on_eval_start(self, info):
        self.events.append("eval_start")

    @override
    def on_eval_end(self, info):
        self.events.append(f"eval {sorted(info.metrics)}")

    @override
    def on_exception(self, info, error):
        self.events.append(f"exception {type(error).__name__}")


def test_hooks_fire_in_documented_order():
    x, y = make_data(64)
    recorder = Recorder()
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[recorder]
    )
    trainer.fit([(x[:32], y[:32]), (x[32:], y[32:])], epochs=2, eval_data=[(x, y)])
    epoch = "['accuracy', 'eval_accuracy', 'eval_loss', 'loss']"
    assert recorder.events == [
        "fit_start",
        "epoch_start 0",
        "step 1",
        "step 2",
        "eval_start",
        "eval ['eval_accuracy', 'eval_loss']",
        f"epoch_end 0 {epoch}",
        "epoch_start 1",
        "step 3",
        "step 4",
        "eval_start",
        "eval ['eval_accuracy', 'eval_loss']",
        f"epoch_end 1 {epoch}",
        "fit_end",
    ]


def test_exception_hook_fires_and_error_propagates():
    x, y = make_data(64)
    recorder = Recorder()
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[recorder]
    )
    with pytest.raises(ValueError, match="labels"):
        trainer.fit([(x, y + 5)])
    assert recorder.events == ["fit_start", "epoch_start 0", "exception ValueError"]


def test_step_metrics_are_lazy_floats():
    seen = []

    class Every2(px.Callback):
        @override
        def on_step_end(self, info):
            if info.step % 2 == 0:
                seen.append(info.metrics)

    x, y = make_data(64)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[Every2()]
    )
    trainer.fit([(x, y)], steps=4)
    assert [sorted(m) for m in seen] == [["accuracy", "loss"]] * 2
    assert all(isinstance(v, float) for m in seen for v in m.values())


def test_host_batches_travel_with_the_step_call(monkeypatch):
    """A NumPy batch goes to the devices as arguments of the compiled step
    (placed by its input shardings, in C++), with no `jax.device_put` of its
    own; all-ones weights (a loader's full batch) use cached device weights,
    and sample weights are placed (weights of one kind: the step compiles
    once)."""
    x, y = make_data(64)
    weights = np.linspace(0.5, 1.5, 64, dtype=np.float32)
    trainer = px.DataParallelTrainer(
        make_model(), optax.sgd(0.1), strategy=px.ShardingStrategy(8)
    )
    trainer.fit([(x, y), (x, y, weights)], epochs=1)  # compiles, caches weights
    transfers, calls = [], []
    device_put, program = jax.device_put, trainer._parts.programs.first
    assert program is not None
    train = program.train

    def counted(*args, **kwargs):
        transfers.append(args)
        return device_put(*args, **kwargs)

    def spied(leaves, sums, flags, batch, weight, total):
        calls.append([type(leaf) for leaf in [*batch, weight]])
        return train(leaves, sums, flags, batch, weight, total)

    monkeypatch.setattr(jax, "device_put", counted)
    trainer._parts.programs.add(program._replace(train=spied))
    ones = np.ones(64, np.float32)
    trainer.fit([(x, y), (x, y, weights), (x, y, ones)], epochs=1)
    # The sample weights alone (the totals are cached; the epoch's zeroed
    # sums are made by `put_replicated`, no `jax.device_put`).
    assert len(transfers) == 1
    (placed,) = transfers
    np.testing.assert_array_equal(placed[0][0], weights)
    cached = type(jnp.zeros(64))  # device weights: a jax.Array
    assert calls == [[np.ndarray, np.ndarray, cached]] * 3


def test_batches_on_an_equivalent_sharding_are_not_placed_again(monkeypatch):
    """`jax.device_put(x)` lays a batch out on one device with a sharding of
    its own; for a strategy of that one device it is already where the step
    wants it: no `jax.device_put` per step (its dispatch cost more than the
    whole step of a small model)."""
    x, y = make_data(64)
    device = jax.devices()[0]
    trainer = px.DataParallelTrainer(
        make_model(), optax.sgd(0.1), strategy=px.ShardingStrategy([device])
    )
    batch = jax.device_put((x, y), device)
    assert batch[0].sharding != trainer.strategy.batch_sharding
    trainer.fit([batch], epochs=1)  # compiles, caches the batch's weights
    transfers = []
    device_put = jax.device_put

    def counted(*args, **kwargs):
        transfers.append(args)
        return device_put(*args, **kwargs)

    monkeypatch.setattr(jax, "device_put", counted)
    trainer.fit([batch] * 5, epochs=1)
    # None at all (the epoch's zeroed sums are made by `put_replicated`, no
    # `jax.device_put`).
    assert transfers == []
