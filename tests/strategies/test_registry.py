"""The strategy registry is the one list of strategies: a strategy added to it
alone appears in the default `assert_equivalent` set-ups, the command line's
choices, the tests' strategy matrix and the composition design; and each
entry declares what its strategy does (its class, whether it accumulates)."""

import argparse
import importlib
from pathlib import Path

import jax
import pytest

import helpers
import phalanx as px
import phalanx.strategies._registry as registry
from cli_runs import cli_args
from phalanx.cli._args import UsageError
from phalanx.cli._main import check_arguments
from phalanx.cli._parser import build_parser
from phalanx.cli._train import make_strategy
from phalanx.strategies._names import strategy_name
from phalanx.testing._setups import default_setups


RowsStrategy = helpers.RowsStrategy


ROWS = registry.Registered(
    "rows",
    "RowsStrategy",
    "RowsStrategy (a test's own)",
    lambda devices, options: RowsStrategy(devices),
    details=lambda strategy: f"rows={strategy.mesh.size}",
)


@pytest.fixture
def with_rows(monkeypatch):
    """The registry with RowsStrategy added, and nothing else changed."""
    monkeypatch.setattr(registry, "REGISTRY", (*registry.REGISTRY, ROWS))


def test_a_registered_strategy_is_in_the_default_setups(with_rows):
    params = helpers.params_of(helpers.make_model())
    setups = dict(default_setups(params))
    name = "RowsStrategy(rows=8) on 8 devices"
    assert name in setups and isinstance(setups[name], RowsStrategy)
    assert strategy_name(RowsStrategy(4)) == "RowsStrategy(rows=4)"


def test_a_registered_strategy_is_a_cli_choice(with_rows):
    (commands,) = [
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ]
    train = commands.choices["train"]
    (action,) = [a for a in train._actions if "--strategy" in a.option_strings]
    assert action.choices is not None and "rows" in action.choices
    assert "RowsStrategy (a test's own)" in str(action.help)
    args = cli_args("--strategy", "rows", "--microbatches", "2")
    check_arguments(args)
    built = make_strategy(args, jax.devices()[:4])
    assert isinstance(built, px.AccumulatingStrategy)
    assert isinstance(built.inner, RowsStrategy) and built.inner.num_devices == 4
    # Another strategy's own option is refused, naming the strategy it is for.
    with pytest.raises(UsageError, match="--shard optimizer .* --strategy fsdp"):
        check_arguments(cli_args("--strategy", "rows", "--shard", "optimizer"))


def test_a_registered_strategy_is_in_the_test_matrix(with_rows):
    assert {"rows", "rows+acc2", "rows+acc4"} <= set(helpers.kinds())
    assert "rows" in helpers.kinds(split=False)
    assert "rows" in helpers.one_of_each()
    made = helpers.make_strategy("rows+acc2", 8)
    assert isinstance(made, px.AccumulatingStrategy)
    assert isinstance(made.inner, RowsStrategy)


def test_a_registered_strategy_is_in_the_composition_design(with_rows, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "compose"))
    combinations = importlib.import_module("combinations")
    assert "rows" in combinations.strategy_names()
    assert isinstance(combinations.strategy("rows"), RowsStrategy)


def test_without_the_entry_nothing_lists_it():
    params = helpers.params_of(helpers.make_model())
    assert not any("Rows" in name for name, _ in default_setups(params))
    assert "rows" not in helpers.kinds()
    with pytest.raises(ValueError, match="'rows' is not registered; choose one of"):
        registry.build("rows")


@pytest.mark.parametrize("entry", registry.registered(), ids=lambda e: e.name)
def test_each_entry_declares_what_its_strategy_does(entry):
    strategy = entry.build(8, helpers.TINY)
    assert type(strategy).__name__ == entry.strategy
    assert registry.entry_of(strategy) is entry
    assert entry.accumulates == (strategy.per_device_reduce() is not None)
    assert entry.summary.startswith(entry.strategy)
    for options in entry.variants.values():
        assert type(entry.build(8, options)).__name__ == entry.strategy
