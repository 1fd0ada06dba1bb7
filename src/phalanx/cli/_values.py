"""The values of ``phalanx train``'s, ``find-lr``'s and ``launch``'s options as
argparse reads them: each converter turns one option's text into its value,
or raises `argparse.ArgumentTypeError` saying how to write it."""

import argparse
import math
from typing import Literal

from .._env import MIN_HANG_TIMEOUT
from .._plan._sizes import parse_size
from ..strategies._axes import MESH_AXES
from ._model import is_reference, parse_model_arg


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def port(text: str) -> int:
    """A TCP port, 1 to 65535 (no option: launch picks a free one)."""
    must = "a TCP port from 1 to 65535"
    return _within(text, 1, 65535, must, fix="leave --port out for a free one")


def non_negative_int(text: str) -> int:
    return _within(text, 0, math.inf, "a whole number, 0 or more")


def _within(text: str, low: int, high: int | float, must: str, fix: str = "") -> int:
    """`text` as an integer from `low` to `high`, or refused: it must be
    `must` (and `fix` says what else to do)."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        also = f"; {fix}" if fix else ""
        raise argparse.ArgumentTypeError(f"must be {must}, got {text!r}{also}")
    return value


def at_least_two(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"must be an integer of at least 2 (a range of rates has two ends), "
            f"got {value}"
        )
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"must be a positive finite number, got {text}"
        )
    return value


def factor_or_off(text: str) -> float | None:
    """A factor above 1, or ``off`` (None)."""
    if text.strip().lower() == "off":
        return None
    return _above(text, 1, "a factor above 1 (e.g. 3) or off")


def seconds_or_off(text: str) -> float | Literal["auto"] | None:
    """A positive number of seconds, ``auto`` or ``off`` (None)."""
    word = text.strip().lower()
    if word in ("off", "auto"):
        return None if word == "off" else "auto"
    must = f"a number of seconds, at least {MIN_HANG_TIMEOUT:g} (e.g. 600), auto or off"
    seconds = _above(text, 0, must)
    if seconds < MIN_HANG_TIMEOUT:
        raise argparse.ArgumentTypeError(f"must be {must}, got {text!r}")
    return seconds


def _above(text: str, bound: int, must: str) -> float:
    """`text` as a finite number above `bound`, or refused: it must be `must`."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > bound):
        raise argparse.ArgumentTypeError(f"must be {must}, got {text!r}")
    return value


def widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of widths, e.g. 256,128"
        ) from None
    if not widths or any(w < 1 for w in widths):
        raise argparse.ArgumentTypeError(
            f"widths must be positive integers, e.g. 256,128; got {text!r}"
        )
    return widths


def model(text: str) -> str:
    if text in ("linear", "mlp") or is_reference(text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is not linear, mlp or MODULE:FACTORY (e.g. mymodels:cnn, a "
        "function in mymodels.py)"
    )


def model_arg(text: str) -> str:
    try:
        parse_model_arg(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def steps(text: str) -> tuple[int, int]:
    start, colon, end = text.partition(":")
    try:
        steps = int(start), int(end)
    except ValueError:
        steps = (0, 0)
    if not colon or not 1 <= steps[0] < steps[1]:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not START:END with 1 <= START < END, e.g. 10:20"
        )
    return steps


def mesh_sizes(text: str) -> dict[str, int]:
    """``data=2,fsdp=4`` as `MeshStrategy`'s sizes (axes not named: 1, or
    ``data`` -1 when not named: what the others leave).

    Raises:
        ValueError: an axis that is not data, fsdp, context or tensor, one
            named twice, or a size that is not an int >= 1 (or -1).
    """
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, equals, value = part.strip().partition("=")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if not equals or name not in MESH_AXES or name in sizes:
            raise ValueError(
                f"{text!r}: {part!r} is not AXIS=SIZE for a distinct axis of "
                f"{', '.join(MESH_AXES)}; e.g. data=2,fsdp=4"
            )
        if size < 1 and size != -1:
            raise ValueError(
                f"{text!r}: {name} must be an int >= 1 (or -1: what the others "
                "leave); e.g. data=2,fsdp=4"
            )
        sizes[name] = size
    return {"data": -1, "fsdp": 1, "context": 1, "tensor": 1} | sizes


def mesh(text: str) -> str:
    """--mesh's text, checked and written as `mesh_sizes` reads it (context
    only where it splits sequences)."""
    try:
        sizes = mesh_sizes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return ",".join(
        f"{name}={size}"
        for name, size in sizes.items()
        if name != "context" or size != 1
    )


def size(text: str) -> int:
    """A memory size (``16GiB``, ``500MB``, bytes)."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def fraction(text: str) -> float:
    """A number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(
            f"must be at least 0 and below 1 (a share, e.g. 0.1), got {text}"
        )
    return value
