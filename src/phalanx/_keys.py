"""A user's builder called with its key as it takes one: by name
(``key=``, keyword-only, as Equinox's layers take it) or by position
(``lambda k: Net(k)``).

`px.models.Stacked` and `px.sharded_model` take a function that builds a
layer or a model from a key. Equinox's own constructors take the key by
name only (``eqx.nn.MLP(..., *, key)``), so a positional call of
``functools.partial(eqx.nn.MLP, 64, 64, 128, 1)`` would fail in Python's
words; both spellings are accepted here. Nothing here calls the builder
before it is asked to.
"""

import inspect
from collections.abc import Callable
from typing import Protocol, TypeAlias, TypeVar, runtime_checkable

from jaxtyping import PRNGKeyArray


_T = TypeVar("_T")
_T_co = TypeVar("_T_co", covariant=True)


# Runtime-checkable: the jaxtyping import hook (the tests') hands the
# annotations it wraps to beartype, which refuses a protocol it cannot check.
@runtime_checkable
class KeyByName(Protocol[_T_co]):
    """A builder that takes its key by name only, as Equinox's layers do
    (``functools.partial(eqx.nn.Linear, 64, 64)``)."""

    def __call__(self, *, key: PRNGKeyArray) -> _T_co: ...


# A user's builder of a `_T` from a key, either way it may take it.
Builder: TypeAlias = Callable[[PRNGKeyArray], _T] | KeyByName[_T]


def with_key(fn: Callable[..., _T], name: str) -> Callable[[PRNGKeyArray], _T]:
    """`fn` as a function of its key: ``fn(key=key)`` where `fn` has a
    parameter named ``key`` (or takes only keywords), else ``fn(key)``.

    Args:
        fn: the user's builder (already checked to be callable).
        name: its argument's name, for the message.

    Raises:
        TypeError: `fn` takes no argument at all.
    """
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return fn
    kinds = {p.kind for p in parameters}
    by_name = any(
        p.name == "key" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        for p in parameters
    )
    positional = kinds & {
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
    }
    if by_name or (not positional and inspect.Parameter.VAR_KEYWORD in kinds):
        return lambda key: fn(key=key)
    if positional:
        return fn
    raise TypeError(
        f"{name}={fn!r} takes no argument; it is called with a key: pass a "
        "function of one, e.g. lambda key: eqx.nn.Linear(64, 64, key=key), or "
        "one taking key= as Equinox's layers do, e.g. "
        "functools.partial(eqx.nn.Linear, 64, 64)"
    )
