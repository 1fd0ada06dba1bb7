"""A hook's call that does not fit the signature of what it calls.

Python checks a call's arguments against the callee's signature before the
callee runs: a keyword it does not take, a required argument missing, too
many positional ones. That TypeError is the mistake of the code that made
the call (the trainer's hook, e.g. ``px.metrics.f1(o, t, nclasses=3)`` in
``metrics``), never of the batch's shapes or dtypes, and is reported as the
hook's. Told apart from other TypeErrors (a dtype JAX refuses, an argument
jaxtyping's check refuses) by three things together: the exact type
TypeError, CPython's message for a call that does not bind, and a
traceback in which the named callee never started (its arguments were
refused at the call, not by a check inside it).
"""

import difflib
import inspect
import re
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from .. import metrics as px_metrics
from ._hooks import HookTypeError


# CPython's messages for arguments that do not bind (Python/ceval.c's and
# Objects/call.c's wording, stable since 3.10): the callee's qualified name,
# then what did not fit.
_UNBOUND = re.compile(
    r"^(?P<name>[\w.<>]+)\(\) (?:"
    r"(?P<unexpected>got an unexpected keyword argument '(?P<keyword>\w+)')"
    r"|(?P<missing>missing \d+ required (?:positional|keyword-only) arguments?)"
    r"|takes (?:from \d+ to )?\d+ positional arguments? but"
    r"|got multiple values for argument"
    r"|got some positional-only arguments passed as keyword arguments"
    r")"
)

# How the engine calls each hook, for a hook whose own signature is wrong.
_HOOK_CALLS = {
    "loss": "loss(model, outputs, targets)",
    "metrics": "metrics(outputs, targets)",
    "eval_metrics": "eval_metrics(outputs, targets)",
}


def call_mistake(error: BaseException, hook: str) -> HookTypeError | None:
    """The hook's mistake to raise in place of `error`, a TypeError caught
    around the call of the trainer's `hook` (``loss``, ``metrics``,
    ``eval_metrics``) where the hook was called; None where `error` is not a
    call whose arguments do not fit (a shape or dtype problem, to be told as
    the batch's)."""
    match = _UNBOUND.match(str(error))
    if type(error) is not TypeError or match is None:
        return None
    name = match["name"]
    frames = _frames(error.__traceback__)
    # The callee named by the message must not have started: a check inside
    # it that raised a look-alike message (by its qualified name, as Python
    # writes it, or its bare one) is its own business.
    if any(name in (f.f_code.co_qualname, f.f_code.co_name) for f in frames[1:]):
        return None
    if len(frames) == 1:  # raised where the engine called the hook itself
        call = _HOOK_CALLS.get(hook, f"{hook}(...)")
        return HookTypeError(
            f"the {hook} hook cannot be called as {call}: {error}; give it "
            f"that signature (as a method: def {hook}(self, "
            f"{call.partition('(')[2]})"
        )
    function = _public_metric(name, frames[-1])
    callee = f"px.metrics.{name}" if function is not None else f"{name}()"
    if match["unexpected"]:
        what = "with an argument it does not take"
    elif match["missing"]:
        what = "without an argument it requires"
    else:
        what = "with arguments that do not fit its signature"
    message = f"the {hook} hook called {callee} {what}: {error}"
    if function is not None:
        signature = _plain_signature(function)
        close = difflib.get_close_matches(
            match["keyword"] or "", list(signature.parameters), n=1
        )
        if close:
            message += f" (did you mean {close[0]}?)"
        message += f"; {callee} takes {signature}"
    return HookTypeError(
        f"{message}: fix the call in {hook}() (the batch is not at fault)"
    )


def _frames(tb: TracebackType | None) -> list[FrameType]:
    """The frames of `tb`, outermost first."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _public_metric(name: str, caller: FrameType) -> Callable[..., Any] | None:
    """The px.metrics function a message names `name`, unless the frame
    that made the call knows `name` as something else (its own ``f1``)."""
    function = getattr(px_metrics, name, None)
    if not callable(function) or getattr(function, "__qualname__", None) != name:
        return None
    own = caller.f_locals.get(name, caller.f_globals.get(name, function))
    return function if own is function else None


def _plain_signature(function: Callable[..., Any]) -> inspect.Signature:
    """`function`'s signature without its annotations, as a user writes a call."""
    signature = inspect.signature(function)
    return signature.replace(
        parameters=[
            p.replace(annotation=p.empty) for p in signature.parameters.values()
        ],
        return_annotation=inspect.Signature.empty,
    )
