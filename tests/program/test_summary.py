"""The model summary: its counts and bytes against the arrays themselves."""

import io

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import optax
import pytest
import rich.console
import rich.table

import phalanx as px
from helpers import STRATEGIES, make_model
from phalanx._engine.program._summary import ModelSummary, format_bytes


def per_device(tree) -> int:
    """The bytes device 0 holds of the arrays of `tree`, from the arrays."""
    arrays = jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    raw = [
        jax.random.key_data(x)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        else x
        for x in arrays
    ]
    return sum(x.addressable_shards[0].data.nbytes for x in raw)


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_summary_counts_what_the_devices_hold(name):
    model = make_model()
    trainer = px.DataParallelTrainer(
        model, optax.adam(1e-2), strategy=STRATEGIES[name]()
    )
    summary, state = trainer.summary(), trainer.state
    params = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    assert summary.total_params == sum(x.size for x in params)
    assert summary.param_bytes == sum(x.nbytes for x in params)
    assert [row.path for row in summary.rows] == [
        "layers[0].weight",
        "layers[0].bias",
        "layers[1].weight",
        "layers[1].bias",
    ]
    assert [row.shape for row in summary.rows] == [x.shape for x in params]
    assert summary.param_bytes_per_device == per_device(
        eqx.filter(state.model, eqx.is_inexact_array)
    )
    assert summary.opt_state_bytes_per_device == per_device(state.opt_state)
    assert summary.state_bytes_per_device == per_device(state)
    assert summary.model_state_bytes == 0
    assert summary.num_devices == trainer.strategy.num_devices
    assert (
        summary.strategy
        == {
            "sharding": "ShardingStrategy",
            "pmap": "PmapStrategy",
            "accumulating": "AccumulatingStrategy(PmapStrategy, microbatches=2)",
            "fsdp": "FullyShardedStrategy",
            "mesh": "MeshStrategy(data=2, fsdp=4)",
        }[name]
    )


def test_fully_sharded_holds_a_part_of_each_large_leaf_per_device():
    model = px.models.MLP(64, 10, hidden=(128,), key=jr.key(0))  # one 8192 leaf

    def summary(strategy: px.Strategy) -> ModelSummary:
        trainer = px.DataParallelTrainer(model, optax.adam(1e-2), strategy=strategy)
        return trainer.summary()

    whole = summary(px.ShardingStrategy(8))
    split = summary(px.FullyShardedStrategy(8))
    zero2 = summary(px.FullyShardedStrategy(8, shard="optimizer"))
    big = whole.rows[0]
    assert big.size == 8192 >= px.FullyShardedStrategy(8).min_size
    assert big.nbytes_per_device == big.nbytes
    assert split.rows[0].nbytes_per_device == big.nbytes // 8
    # The small leaves stay whole.
    assert [r.nbytes_per_device for r in split.rows[1:]] == [
        r.nbytes for r in whole.rows[1:]
    ]
    saved = big.nbytes - big.nbytes // 8
    assert split.param_bytes_per_device == whole.param_bytes_per_device - saved
    assert split.opt_state_bytes_per_device == (
        whole.opt_state_bytes_per_device - 2 * saved  # adam's mu and nu
    )
    assert zero2.param_bytes_per_device == whole.param_bytes_per_device
    assert zero2.opt_state_bytes_per_device == split.opt_state_bytes_per_device
    assert split.param_bytes == whole.param_bytes
    assert split.state_bytes_per_device < whole.state_bytes_per_device


def test_model_state_is_counted():
    class Normed(eqx.Module):
        linear: eqx.nn.Linear
        norm: eqx.nn.BatchNorm

        def __call__(self, x, state):
            return self.norm(self.linear(x), state)

    model, model_state = eqx.nn.make_with_state(Normed)(
        eqx.nn.Linear(4, 3, key=jr.key(0)),
        eqx.nn.BatchNorm(3, axis_name="batch", mode="batch"),
    )
    trainer = px.DataParallelTrainer(
        model, optax.sgd(0.1), model_state=model_state, loss="mse"
    )
    summary = trainer.summary()
    assert summary.model == "Normed"
    assert summary.total_params == 4 * 3 + 3 + 3 + 3
    expected = sum(x.nbytes for x in jax.tree.leaves(model_state))
    assert summary.model_state_bytes == expected > 0
    assert summary.model_state_bytes_per_device == expected  # replicated
    assert f"model state {format_bytes(expected)} per device" in summary.short()


def test_the_summary_renders_as_text_and_with_rich():
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=px.ShardingStrategy(8)
    )
    summary = trainer.summary()
    # 5 * 8 + 8 + 8 * 3 + 3 = 75 float32 parameters; adam: a count and two copies.
    assert summary.short() == (
        "MLP: 75 parameters (300 B; 300 B per device), optimizer state 604 B "
        "per device, ShardingStrategy on 8 devices"
    )
    text = str(summary)
    lines = text.splitlines()
    assert "\x1b" not in text
    assert "MLP under ShardingStrategy on 8 devices" in lines[0]
    assert cells(lines, "layers[0].weight") == [
        "layers[0].weight",
        "[8, 5]",
        "float32",
        "40",
        "160 B",
        "160 B",
    ]
    assert cells(lines, "Total") == ["Total", "", "", "75", "300 B", "300 B"]
    assert "optimizer state 604 B (604 B per device)" in lines
    assert all(line == line.rstrip() for line in lines)

    table = summary.__rich__()
    assert isinstance(table, rich.table.Table)
    assert len(table.rows) == 4
    console = rich.console.Console(file=io.StringIO(), width=200)
    console.print(summary)
    printed = console.file.getvalue()  # pyright: ignore[reportAttributeAccessIssue]
    assert "layers[1].bias" in printed and "Per device" in printed


def cells(lines: list[str], first: str) -> list[str]:
    """The cells of the text table's row that begins with `first`."""
    (row,) = [line for line in lines if line.startswith(f"│ {first} ")]
    return [cell.strip() for cell in row.split("│")[1:-1]]


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (172_584, "168.5 KiB"),
        (2**20 - 1, "1.0 MiB"),  # rounded up into the next unit
        (3 * 2**30, "3.0 GiB"),
        (np.int64(5 * 2**40), "5.0 TiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(int(n)) == text


def test_given_a_batch_the_summary_says_what_a_step_takes_per_device():
    model = px.models.MLP(64, 10, hidden=(128,), key=jr.key(0))
    x, y = np.ones((2048, 64), np.float32), np.zeros(2048, np.int32)

    def summary(strategy: px.Strategy, rows: int) -> ModelSummary:
        trainer = px.DataParallelTrainer(model, optax.adam(1e-2), strategy=strategy)
        summary = trainer.summary((x[:rows], y[:rows]))
        assert int(trainer.state.step) == 0  # compiled, not run
        assert trainer.summary().step is None  # no batch, no step
        return summary

    small = summary(px.ShardingStrategy(8), 64)
    large = summary(px.ShardingStrategy(8), 2048)
    split = summary(px.FullyShardedStrategy(8), 64)
    assert small.step is not None and large.step is not None
    assert split.step is not None
    # The step's inputs are the state and the batch (8 of 64 rows here).
    assert small.step.arguments >= small.state_bytes_per_device + 8 * 64 * 4
    # The state is donated: the new state reuses its buffers.
    assert 0 < small.step.aliased <= small.step.outputs
    assert small.step.peak >= small.step.arguments + small.step.temporaries
    # 256 rows per device, not 8: more activations, the same state; each
    # row brings 64 features, a label and its weight in the loss.
    assert large.step.temporaries > small.step.temporaries
    assert large.step.arguments - small.step.arguments == (256 - 8) * (64 + 2) * 4
    # Split parameters and optimizer state: less in, gathered inside.
    assert split.step.arguments < small.step.arguments
    assert f"step peak {format_bytes(small.step.peak)} per device" in small.short()
    assert "train step: peak" in str(small)
