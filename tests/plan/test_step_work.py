"""The compiled step's FLOPs as `_cost.step_work` reads them from XLA:TPU's
own programs: `tpu_v5e_hlo.json` holds programs compiled for a TPU v5e
ahead of time (`jax.experimental.topologies`, libtpu 0.0.42, JAX 0.10.2;
metadata stripped) and each one's FLOPs counted by hand.

XLA:TPU writes every matrix multiply as a ``convolution``, a batched one
with its batch axes as spatial axes whose window taps all fall in a
dilation's holes but one (``window={size=4x8 stride=3x7 lhs_dilate=4x8}``).
Counting every tap counted the batch twice: the planner predicted 81 TFLOPs
a step for the tests' 19 M transformer on the chip, 37 times its 2.2."""

import itertools
import json
import pathlib

import pytest

from phalanx._plan._cost import _mean_taps, step_work


PROGRAMS = json.loads(pathlib.Path(__file__).with_name("tpu_v5e_hlo.json").read_text())


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_tpu_programs_flops_are_its_multiply_adds(name):
    """Batched matrix multiplies (attention's two), a plain one, one's
    gradient, and a padded and a strided convolution with its gradients
    (padding, lhs and rhs dilation): each multiply-add that meets an input
    element, twice."""
    program = PROGRAMS[name]
    assert step_work(program["hlo"], 1).flops == program["flops"]


def _brute_taps(out, size, window, stride, low, lhs, rhs):
    hits = 0
    for o, k in itertools.product(range(out), range(window)):
        at = o * stride + k * rhs - low
        hits += 0 <= at <= (size - 1) * lhs and at % lhs == 0
    return hits / out


def test_window_taps_count_the_input_elements_each_output_meets():
    """Against counting every (output, tap) pair, over windows with and
    without padding, strides and both dilations."""
    grid = itertools.product(
        (1, 5, 8), (1, 3, 4), (1, 2, 3), (0, 2), (0, 1), (1, 2, 3), (1, 2)
    )
    for size, window, stride, low, high, lhs, rhs in grid:
        span = (size - 1) * lhs + 1 + low + high - ((window - 1) * rhs + 1)
        if span < 0:
            continue
        out = span // stride + 1
        found = _mean_taps(out, size, window, stride, low, lhs, rhs)
        brute = _brute_taps(out, size, window, stride, low, lhs, rhs)
        assert found == pytest.approx(brute), (size, window, stride, low, lhs, rhs)
