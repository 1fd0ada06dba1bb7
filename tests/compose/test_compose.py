"""Invariant 8: features compose. An all-pairs design over strategy,
precision, steps a call, EMA, parameter groups, a dataset metric (F1), the
evaluation cadence, the Timeline, a plateau on a schedule and a kill with a
resume: every pair of option values is in some row, and every row trains
(none is refused), gives one device's update within its precision's
tolerance, logs the names its options call for (in the history and in a
logger placed before the callbacks that add them), keeps every group's
optimizer state laid out as its parameters, and, killed and resumed, ends
bit for bit where the run never stopped did. The one-device runs compared
with are checked too: their average, and the plateau's effect on the
update."""

import pathlib

import pytest

from checks import (
    Failures,
    References,
    check_bitwise,
    check_layout,
    check_names,
    check_update,
)
from combinations import OPTIONS, Combination, all_pairs, rows, uncovered
from runs import train


DESIGN = rows()


def test_every_pair_of_options_is_in_a_row():
    assert uncovered(DESIGN) == []
    # Far fewer runs than the full product (5 * 2**9 = 2,560).
    assert len(DESIGN) <= 16
    assert len({row.name for row in DESIGN}) == len(DESIGN)
    assert all_pairs() == 234
    for option, values in OPTIONS.items():
        assert {getattr(row, option) for row in DESIGN} == set(values)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> References:
    """The one-device runs of this module's rows."""
    return References(tmp_path_factory.mktemp("references"))


@pytest.mark.parametrize("combo", DESIGN, ids=[row.name for row in DESIGN])
def test_the_combination_is_one_device_and_resumes_bitwise(
    combo: Combination, references, tmp_path: pathlib.Path
):
    failures = Failures()
    straight = train(combo, tmp_path / "straight")
    failures.check(check_names, combo, straight, combo.name)
    failures.check(check_layout, combo, straight)
    failures.check(references.check_reference, combo.reference())
    failures.check(check_update, combo, straight, references)
    if combo.resume:
        train(combo, tmp_path / "resumed", crash=True)
        resumed = train(combo, tmp_path / "resumed", resume=True)
        failures.check(check_names, combo, resumed, f"{combo.name}, resumed")
        failures.check(check_bitwise, straight, resumed, combo.name)
    failures.raise_any(combo.name)
