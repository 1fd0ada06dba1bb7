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

from phalanx._plan._cost import step_work
from phalanx._plan._hlo import hbm_bytes
from phalanx._plan._hlo_flops import _mean_taps


PROGRAMS = json.loads(pathlib.Path(__file__).with_name("tpu_v5e_hlo.json").read_text())


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_tpu_programs_flops_are_its_multiply_adds(name):
    """Batched matrix multiplies (attention's two), a plain one, one's
    gradient, a padded and a strided convolution with its gradients
    (padding, lhs and rhs dilation), one reading a prefetched layer, and a
    `lax.scan` of 4 (XLA:TPU prints no trip count: its condition's ``i <
    4`` says it): each multiply-add that meets an input element, twice."""
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


MATRIX = 512 * 512 * 4


def test_on_chip_buffers_move_no_device_memory():
    """XLA:TPU's vector memory (``S(1)``) and its flags (``S(2)``) are not
    the device's memory: their bytes are no traffic."""
    prefetch = (
        "((f32[6,512,512]{2,1,0:T(8,128)}), f32[2,512,512]{2,1,0:T(8,128)S(1)}, "
        "s32[]{:S(2)})"
    )
    assert hbm_bytes(prefetch) == 6 * MATRIX
    assert hbm_bytes("f32[512,512]{1,0:T(8,128)S(1)}") == 0
    assert hbm_bytes("f32[512,512]") == hbm_bytes("f32[512,512]{1,0}") == MATRIX


def test_kernels_are_timed_each_at_their_slower_pace():
    """In the hand-written "prefetched" program (as XLA:TPU prints one: a
    layer's weights sliced out of a stack of 6 into on-chip memory, a matrix
    multiply reading them there, then an elementwise kernel), the
    asynchronous slice reads its 2 layers once (not the stack of 6, nor
    again when done) into on-chip memory; the product reads x from the
    device's memory and the layer on-chip; each kernel takes the longer of
    its FLOPs and its bytes at the rates given, one after another."""
    flops, bytes_per_second = 1e12, 1e9
    work = step_work(PROGRAMS["prefetched"]["hlo"], 1, (flops, bytes_per_second))
    product = 2.0 * 512**3
    kernels = [
        (0.0, 2 * MATRIX),  # the slice: 2 layers read, written on-chip
        (product, 2 * MATRIX),  # x read, its product written
        (0.0, 2 * MATRIX),  # tanh: read and written
    ]
    assert work.flops == product
    assert work.bytes == sum(moved for _, moved in kernels)
    assert work.seconds == pytest.approx(
        sum(max(f / flops, moved / bytes_per_second) for f, moved in kernels)
    )
