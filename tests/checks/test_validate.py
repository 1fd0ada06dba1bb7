"""The shared argument checks: what they accept, that a bool is never a
count, and that each message names the argument, its value and the fix."""

import math

import numpy as np
import pytest

from phalanx import _validate as v


def test_accepted_values_are_returned():
    assert v.positive_int("keep", 3, example="keep=3") == 3
    assert v.int_at_least("prefetch", 0, 0) == 0
    assert v.optional_positive_int("epochs", None) is None
    assert v.optional_int_at_least("prefetch", 2, 0) == 2
    assert v.integer("seed", -5) == -5
    assert v.integer("seed", np.int64(4), minimum=0, numpy=True) == 4
    assert v.finite_at_least("min_delta", 0, 0.0) == 0.0
    assert v.boolean("shuffle", np.True_, numpy=True) is True
    assert v.one_of("mode", "max", ("min", "max")) == "max"


def test_bools_are_not_ints():
    assert v.is_int(3) and not v.is_int(True) and not v.is_int(3.0)
    assert v.is_real(np.float32(1)) and not v.is_real(False) and not v.is_real("1")
    with pytest.raises(ValueError, match=r"log_every=True must be an int >= 1"):
        v.positive_int("log_every", True)
    with pytest.raises(TypeError, match=r"seed=False must be an int"):
        v.integer("seed", False, numpy=True)
    with pytest.raises(ValueError, match=r"min_delta=True"):
        v.finite_at_least("min_delta", True, 0.0)


@pytest.mark.parametrize(
    "check, error, message",
    [
        (
            lambda: v.positive_int("keep", 0, example="keep=3"),
            ValueError,
            "keep=0 must be an int >= 1, e.g. keep=3",
        ),
        (
            lambda: v.optional_int_at_least("prefetch", 1.5, 0, hint="ahead"),
            ValueError,
            "prefetch=1.5 must be an int >= 0 or None (ahead)",
        ),
        (
            lambda: v.integer("seed", "0", example="seed=0"),
            TypeError,
            "seed='0' must be an int, e.g. seed=0",
        ),
        (
            lambda: v.integer("batch_size", np.int64(0), minimum=1, numpy=True),
            ValueError,
            "batch_size=np.int64(0) must be at least 1",
        ),
        (
            lambda: v.integer("batch_size", np.int64(8), minimum=1),
            TypeError,
            "batch_size=np.int64(8) must be an int",
        ),
        (
            lambda: v.finite_at_least("min_delta", math.inf, 0.0, example="1e-4"),
            ValueError,
            "min_delta=inf must be a finite number >= 0, e.g. 1e-4",
        ),
        (
            lambda: v.boolean("restore_best_weights", 1),
            TypeError,
            "restore_best_weights=1 must be True or False",
        ),
        (
            lambda: v.one_of("nan_policy", "ignore", ("raise", "skip", "off")),
            ValueError,
            "nan_policy='ignore' must be 'raise', 'skip' or 'off'",
        ),
    ],
)
def test_messages_name_the_argument_value_and_fix(check, error, message):
    with pytest.raises(error) as caught:
        check()
    assert str(caught.value) == message
