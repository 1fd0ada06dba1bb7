"""A user's own model and data for ``phalanx train``: ``--model
MODULE:FACTORY`` (with ``--model-arg NAME=VALUE``) and ``--dataset
MODULE:FUNCTION``, imported from the current folder or ``PYTHONPATH``.

The user's code runs here (imported, called, and the model traced on one
example) before the run folder is made: what it raises becomes a
`UserCodeError` that keeps its traceback and adds one line of context.
"""

import ast
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ._args import UsageError


# The keywords phalanx passes a model factory itself.
FACTORY_KEYWORDS = ("in_shape", "out_size", "key")
# The likely cause when a user's model fails on the built-in data.
DIGITS_HINT = (
    "; the built-in digits (--dataset digits) are rows of 64 features, "
    "in_shape=(64,): for images pass --dataset npz:PATH, mnist:PATH or "
    "MODULE:FUNCTION"
)


class UserCodeError(Exception):
    """The user's own code raised: the module or factory of --model, the
    model it built (traced on one example) or the --dataset function. The
    message is one line of context; the user's exception is the cause,
    reported with its traceback."""


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
        UsageError: the module or the name is missing.
        UserCodeError: importing the module raised.
    """
    module_name, _, name = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        missing = error.name if isinstance(error, ModuleNotFoundError) else None
        if missing is not None and module_name.startswith(missing):
            raise UsageError(
                f"{option} {spec}: no module named {missing!r} in the current "
                f"folder ({os.getcwd()}) or on PYTHONPATH; run from the folder "
                "that holds it, or add that folder to PYTHONPATH"
            ) from None
        # The module was found, and raised (or something it imports is missing).
        raise UserCodeError(
            f"{option} {spec}: importing {module_name} raised {_brief(error)} "
            "(traceback above)"
        ) from error
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
    hint: str = "",
) -> Any:
    """Call the factory; what it returns must be an Equinox module.

    Raises:
        UserCodeError: the factory raised (`hint`: the likely cause, if any).
        UsageError: it returned something else than an Equinox module.
    """
    import equinox as eqx

    try:
        model = factory(in_shape=in_shape, out_size=out_size, key=key, **arguments)
    except Exception as error:
        given = ", ".join(
            [
                f"in_shape={in_shape}",
                f"out_size={out_size}",
                "key=<PRNG key>",
                *(f"{name}={value!r}" for name, value in arguments.items()),
            ]
        )
        raise UserCodeError(
            f"--model {spec}: {spec.partition(':')[2]}({given}) raised "
            f"{_brief(error)} (traceback above){hint}"
        ) from error
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
    try:
        arrays = function()
    except Exception as error:
        raise UserCodeError(
            f"--dataset {spec}: {name}() raised {_brief(error)} (traceback above)"
        ) from error
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


def check_model(
    spec: str, model: Any, x: np.ndarray, y: np.ndarray, hint: str = ""
) -> None:
    """Trace `model` on one example of `x` as the trainer calls it
    (vmapped over the batch, with a ``key`` if it takes one): its output per
    example must be one float logit per class of the labels `y`.

    Raises:
        UserCodeError: the model raised (`hint`: the likely cause, if any).
        UsageError: its output does not fit the labels.
    """
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from .._engine.step._forward import takes_key

    pass_key = takes_key(model)

    def one_batch(model: Any, x: Any) -> Any:
        def one(x: Any, key: Any) -> Any:
            return model(x, key=key) if pass_key else model(x)

        keys = jax.random.split(jax.random.key(0), len(x))
        return jax.vmap(one, axis_name="batch")(x, keys)

    example = jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype)
    shown = f"one example of shape {tuple(x.shape[1:])}"
    try:
        out = eqx.filter_eval_shape(one_batch, model, example)
    except Exception as error:
        call = "model(x, key=key)" if pass_key else "model(x)"
        raise UserCodeError(
            f"--model {spec}: the {type(model).__name__} it built, called on "
            f"{shown} as {call} (vmapped over the batch), raised "
            f"{_brief(error)} (traceback above){hint}"
        ) from error
    classes, low, high = int(y.max()) + 1, int(y.min()), int(y.max())
    if isinstance(out, jax.ShapeDtypeStruct):
        got = f"an output of shape {tuple(out.shape[1:])}"
        if out.shape[1:] == (classes,) and jnp.issubdtype(out.dtype, jnp.floating):
            return
        if out.shape[1:] == (classes,):
            got += f" and dtype {out.dtype}"
    else:
        got = f"{_describe(out)} (not one array)"
    raise UsageError(
        f"--model {spec}: the model maps {shown} to {got}, but the labels run "
        f"from {low} to {high}: phalanx train's cross-entropy needs one float "
        f"logit per class, an output of shape ({classes},) per example (the "
        f"factory's out_size={classes})"
    )


def _brief(error: BaseException, limit: int = 300) -> str:
    """`error` on one line: its type and message, at most about `limit`
    characters (its middle left out)."""
    text = " ".join(str(error).split())
    if len(text) > limit:  # its start says what failed, its end why
        text = f"{text[: limit // 2].rstrip()} ... {text[-limit // 2 :].lstrip()}"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _describe(value: Any) -> str:
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"
