"""Argument checks shared by every public entry point: the lowest layer.

Each check returns the value it accepted, so a constructor reads
``self.keep = positive_int("keep", keep, example="keep=3")``, and raises a
built-in exception whose message names the argument, its value and the fix:
``keep=0 must be an int >= 1, e.g. keep=3``. `example` is appended as
``, e.g. <example>`` and `hint` (what the argument means, or why) in
parentheses after it.

A bool is an int to Python but never a count here: ``log_every=True`` is
refused. NumPy scalars are refused too, unless a check is told ``numpy=True``
(array-side arguments, such as a loader's, often arrive as NumPy scalars).

This module imports nothing from phalanx, so any layer may use it.
"""

import math
import numbers
from collections.abc import Sequence
from typing import TypedDict, TypeGuard, TypeVar, Unpack, cast

import numpy as np


_T = TypeVar("_T")


def is_int(value: object) -> TypeGuard[int]:
    """Whether `value` is a Python int and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> TypeGuard[numbers.Real]:
    """Whether `value` is a real number (a `numbers.Real`: a Python or NumPy
    int or float) and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class _Fix(TypedDict, total=False):
    """The keywords every check takes for the end of its message."""

    example: str | None
    hint: str | None


def _fix(fix: _Fix) -> str:
    """The end of a message: ``, e.g. <example> (<hint>)``, each part if given."""
    example, hint = fix.get("example"), fix.get("hint")
    return (f", e.g. {example}" if example else "") + (f" ({hint})" if hint else "")


def int_at_least(name: str, value: object, minimum: int, **fix: Unpack[_Fix]) -> int:
    """`value` if it is an int >= `minimum`.

    Raises:
        ValueError: anything else, a bool or a float included.
    """
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}{_fix(fix)}")
    return value


def optional_int_at_least(
    name: str, value: object, minimum: int, **fix: Unpack[_Fix]
) -> int | None:
    """`value` if it is None or an int >= `minimum`.

    Raises:
        ValueError: anything else.
    """
    if value is not None and (not is_int(value) or value < minimum):
        raise ValueError(
            f"{name}={value!r} must be an int >= {minimum} or None{_fix(fix)}"
        )
    return value


def positive_int(name: str, value: object, **fix: Unpack[_Fix]) -> int:
    """`value` if it is an int >= 1 (`int_at_least` with minimum 1).

    Raises:
        ValueError: anything else.
    """
    return int_at_least(name, value, 1, **fix)


def optional_positive_int(name: str, value: object, **fix: Unpack[_Fix]) -> int | None:
    """`value` if it is None or an int >= 1.

    Raises:
        ValueError: anything else.
    """
    return optional_int_at_least(name, value, 1, **fix)


def integer(
    name: str,
    value: object,
    *,
    minimum: int | None = None,
    numpy: bool = False,
    **fix: Unpack[_Fix],
) -> int:
    """`value` as an int, if it is one (with `numpy`, a NumPy integer too) and
    at least `minimum` (if given). Unlike `int_at_least`, the wrong type and the
    wrong value raise different errors.

    Raises:
        TypeError: `value` is not an int (a bool is not).
        ValueError: `value` is below `minimum`.
    """
    number = int(value) if numpy and isinstance(value, np.integer) else value
    if not is_int(number):
        raise TypeError(f"{name}={value!r} must be an int{_fix(fix)}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name}={value!r} must be at least {minimum}{_fix(fix)}")
    return number


def finite_at_least(
    name: str, value: object, minimum: float, **fix: Unpack[_Fix]
) -> float:
    """`value` as a float, if it is a finite Python int or float >= `minimum`.

    Raises:
        ValueError: anything else (a bool, NaN or an infinity included).
    """
    if not (is_int(value) or isinstance(value, float)) or not (
        value >= minimum and math.isfinite(value)
    ):
        raise ValueError(
            f"{name}={value!r} must be a finite number >= {minimum:g}{_fix(fix)}"
        )
    return float(value)


def boolean(name: str, value: object, *, numpy: bool = False) -> bool:
    """`value` as a bool, if it is True or False (with `numpy`, a NumPy bool
    too).

    Raises:
        TypeError: anything else (``0`` and ``1`` included).
    """
    if isinstance(value, bool) or (numpy and isinstance(value, np.bool_)):
        return bool(value)
    raise TypeError(f"{name}={value!r} must be True or False")


def one_of(
    name: str, value: object, choices: Sequence[_T], *, hint: str | None = None
) -> _T:
    """`value` if it is one of `choices`.

    Raises:
        ValueError: it is not; the message lists the choices.
    """
    if value in choices:
        return cast(_T, value)
    *rest, last = [repr(choice) for choice in choices]
    alternatives = f"{', '.join(rest)} or {last}" if rest else last
    raise ValueError(f"{name}={value!r} must be {alternatives}{_fix({'hint': hint})}")
