"""The FLOPs of one instruction of a compiled program's HLO text: a
``dot``'s, or a ``convolution``'s (XLA:TPU writes every matrix multiply as
one); every other instruction's are 0 (elementwise work is costed as
memory traffic)."""

import math
import re

import numpy as np


_CONTRACTING = re.compile(r"\blhs_contracting_dims=\{([0-9,]*)\}")
_LABELS = re.compile(r"\bdim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"\bwindow=\{([^}]*)\}")
_DIMS = re.compile(r"\[([0-9,]*)\]")


def instruction_flops(
    op: str, result: str, operands: list[str], attributes: str
) -> float:
    """The FLOPs of instruction `op` with `result` type and `operands`'
    types (their text, as the module prints them) and its `attributes`."""
    if op not in ("dot", "convolution") or len(operands) < 2:
        return 0.0
    if op == "dot":
        lhs = _dims(operands[0])
        contracting = _CONTRACTING.search(attributes)
        axes = (
            [int(a) for a in contracting.group(1).split(",") if a]
            if contracting
            else []
        )
        depth = math.prod(lhs[a] for a in axes if a < len(lhs))
        return 2.0 * math.prod(_dims(result)) * depth
    return _convolution_flops(result, operands, attributes)


def _dims(type_text: str) -> list[int]:
    found = _DIMS.search(type_text)
    return [int(d) for d in found.group(1).split(",") if d] if found else []


def _convolution_flops(result: str, operands: list[str], attributes: str) -> float:
    """A ``convolution``'s FLOPs: 2 per multiply-add that meets an input
    element, not padding nor a dilation's hole. XLA:TPU writes a batched
    matrix multiply as one: its batch axes spatial, each window tap but
    one falling in a hole (``window={size=8 stride=7 lhs_dilate=8}``), so
    counting every tap would count the batch twice."""
    labels = _LABELS.search(attributes)
    lhs, kernel, out = _dims(operands[0]), _dims(operands[1]), _dims(result)
    if labels is None or not (
        len(labels.group(1)) == len(lhs)
        and len(labels.group(2)) == len(kernel)
        and len(labels.group(3)) == len(out)
    ):
        return 0.0  # unread: the traced count stands (`_measure.measure`)
    lhs_labels, kernel_labels, out_labels = labels.groups()
    window = _window(attributes, sum(c.isdigit() for c in out_labels))
    taps = 1.0
    for axis, (width, stride, low, lhs_dilate, rhs_dilate) in enumerate(window):
        spatial = str(axis)
        taps *= _mean_taps(
            out[out_labels.index(spatial)],
            lhs[lhs_labels.index(spatial)],
            width, stride, low, lhs_dilate, rhs_dilate,
        )  # fmt: skip
    return 2.0 * math.prod(out) * kernel[kernel_labels.index("i")] * taps


def _window(attributes: str, spatial: int) -> list[tuple[int, int, int, int, int]]:
    """Each spatial axis's window: its size, stride, low padding and lhs
    and rhs dilations (XLA's defaults where the text leaves them out)."""
    fields = dict.fromkeys(
        ("size", "stride", "lhs_dilate", "rhs_dilate"), [1] * spatial
    )
    low = [0] * spatial
    found = _WINDOW.search(attributes)
    for item in found.group(1).split() if found else []:
        key, _, value = item.partition("=")
        if key in fields:
            fields[key] = [int(v) for v in value.split("x")]
        elif key == "pad":
            low = [int(pair.split("_")[0]) for pair in value.split("x")]
    return list(
        zip(
            fields["size"],
            fields["stride"],
            low,
            fields["lhs_dilate"],
            fields["rhs_dilate"],
            strict=True,
        )  # fmt: skip
    )


def _mean_taps(
    out: int, size: int, window: int, stride: int, low: int, lhs: int, rhs: int
) -> float:
    """The window taps per output position, on one spatial axis, that land
    on an input element: position ``o·stride + k·rhs − low`` of the input
    dilated by `lhs` (an element where it is a multiple of `lhs` within
    ``[0, (size − 1)·lhs]``), over the `out` positions."""
    o = np.arange(out, dtype=np.int64)
    start = o * stride - low  # tap k's position: start + k·rhs
    # The taps within the input's span: k in [first, last].
    first = np.maximum(0, -(start // rhs))
    last = np.minimum(window - 1, ((size - 1) * lhs - start) // rhs)
    if lhs == 1:
        return float(np.maximum(last - first + 1, 0).sum()) / max(out, 1)
    # Of those, the taps on an element: start + k·rhs ≡ 0 (mod lhs).
    common = math.gcd(rhs, lhs)
    period = lhs // common
    solvable = start % common == 0
    inverse = pow(rhs // common, -1, period) if period > 1 else 0
    residue = ((-start // common) * inverse) % period if period > 1 else 0 * start
    lowest = first + (residue - first) % period  # the first such k >= first
    counted = np.where(solvable & (lowest <= last), (last - lowest) // period + 1, 0)
    return float(counted.sum()) / max(out, 1)
