"""A user's own model and data for ``phalanx train``: ``--model
MODULE:FACTORY`` (with ``--model-arg NAME=VALUE``) and ``--dataset
MODULE:FUNCTION``, imported from the current folder or ``PYTHONPATH``."""

import ast
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ._cli_args import UsageError


# The keywords phalanx passes a model factory itself.
FACTORY_KEYWORDS = ("in_shape", "out_size", "key")


def is_reference(text: str) -> bool:
    """Whether `text` has the form MODULE:NAME (dotted module, identifier)."""
    module, colon, name = text.partition(":")
    return (
        bool(colon)
        and all(part.isidentifier() for part in module.split("."))
        and name.isidentifier()
    )


def parse_model_arg(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` as a name and the Python literal VALUE.

    Raises:
        ValueError: the message says what is wrong and how to write it.
    """
    name, equals, value = text.partition("=")
    name = name.strip()
    if not equals or not name.isidentifier():
        raise ValueError(
            f"{text!r} is not NAME=VALUE, e.g. --model-arg channels=16 or "
            "--model-arg widths=(32,64)"
        )
    if name in FACTORY_KEYWORDS:
        raise ValueError(
            f"{name} is passed by phalanx itself ({', '.join(FACTORY_KEYWORDS)}); "
            "give the factory's other keyword arguments"
        )
    try:
        literal = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ValueError(
            f"{name}={value!r}: {value!r} is not a Python literal; quote strings "
            f"(--model-arg \"{name}='{value}'\"), write numbers, tuples, lists or "
            "True/False as in Python"
        ) from None
    return name, literal


def model_args(texts: tuple[str, ...]) -> dict[str, Any]:
    """The --model-arg values by name (each checked by `parse_model_arg`)."""
    out: dict[str, Any] = {}
    for text in texts:
        name, value = parse_model_arg(text)
        if name in out:
            raise UsageError(
                f"--model-arg {name} is given twice ({out[name]!r} and {value!r}); "
                "give each once"
            )
        out[name] = value
    return out


def import_reference(spec: str, option: str) -> Any:
    """The object MODULE:NAME names, its module imported from the current
    folder or PYTHONPATH.

    Raises:
        UsageError: the module or the name is missing (an error inside the
            module while it is imported propagates, with its traceback).
    """
    module_name, _, name = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not module_name.startswith(error.name):
            raise  # the module was found; something it imports was not
        raise UsageError(
            f"{option} {spec}: no module named {error.name!r} in the current "
            f"folder ({os.getcwd()}) or on PYTHONPATH; run from the folder that "
            "holds it, or add that folder to PYTHONPATH"
        ) from None
    try:
        return getattr(module, name)
    except AttributeError:
        public = sorted(
            n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
        )
        raise UsageError(
            f"{option} {spec}: module {module_name} ({module.__file__}) has no "
            f"{name!r}; its callables: {', '.join(public) or 'none'}"
        ) from None


def model_factory(spec: str, arguments: dict[str, Any]) -> Callable[..., Any]:
    """The factory --model names, checked to take ``in_shape``, ``out_size``,
    ``key`` and the --model-arg names as keywords (without calling it)."""
    factory = import_reference(spec, "--model")
    if not callable(factory):
        raise UsageError(
            f"--model {spec}: {spec.partition(':')[2]} is not callable "
            f"({type(factory).__name__}); name a function (*, in_shape, out_size, "
            "key, ...) that returns an Equinox module"
        )
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return factory  # a builtin without one: calling it will tell
    keywords = {name: None for name in (*FACTORY_KEYWORDS, *arguments)}
    try:
        signature.bind(**keywords)
    except TypeError as error:
        given = ", ".join(f"{name}=..." for name in keywords)
        raise UsageError(
            f"--model {spec}: cannot call {spec.partition(':')[2]}{signature} as "
            f"{spec.partition(':')[2]}({given}): {error}; it must take in_shape, "
            "out_size and key as keywords (and each --model-arg)"
        ) from None
    return factory


def build_model(
    spec: str,
    factory: Callable[..., Any],
    arguments: dict[str, Any],
    *,
    in_shape: tuple[int, ...],
    out_size: int,
    key: Any,
) -> Any:
    """Call the factory; what it returns must be an Equinox module."""
    import equinox as eqx

    model = factory(in_shape=in_shape, out_size=out_size, key=key, **arguments)
    if not isinstance(model, eqx.Module):
        raise UsageError(
            f"--model {spec}: {spec.partition(':')[2]}(...) returned a "
            f"{type(model).__name__}, not an Equinox module (eqx.Module); return "
            "the model itself"
        )
    return model


def user_dataset(spec: str) -> list[np.ndarray]:
    """``FUNCTION()``'s (x_train, y_train, x_test, y_test), as NumPy arrays."""
    function = import_reference(spec, "--dataset")
    name = spec.partition(":")[2]
    if not callable(function):
        raise UsageError(
            f"--dataset {spec}: {name} is not callable ({type(function).__name__}); "
            "name a function () -> (x_train, y_train, x_test, y_test)"
        )
    arrays = function()
    if not (isinstance(arrays, tuple | list) and len(arrays) == 4):
        raise UsageError(
            f"--dataset {spec}: {name}() returned "
            f"{_describe(arrays)}; return a tuple (x_train, y_train, x_test, "
            "y_test) of NumPy arrays"
        )
    try:
        return [np.asarray(a) for a in arrays]
    except (TypeError, ValueError) as error:
        raise UsageError(
            f"--dataset {spec}: {name}() returned something that is not four "
            f"arrays ({error}); return NumPy arrays"
        ) from None


def _describe(value: Any) -> str:
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"
