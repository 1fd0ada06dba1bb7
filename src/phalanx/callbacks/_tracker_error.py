"""`TrackerError`: an experiment tracker's failure (W&B, MLflow) raised as
phalanx's own error, the library's exception kept as its ``__cause__``.

Only the trackers' calls into their libraries are wrapped; a bug of phalanx's
own around them is not disguised as a tracker failure.
"""

import contextlib
from collections.abc import Iterator


class TrackerError(RuntimeError):
    """An experiment tracker failed: W&B or MLflow could not start, log to or
    end its run (a tracking server that does not answer, a bad setting).

    The message names the logger, what it was doing, where, the library's
    own error in short and what to do; that error itself is the
    ``__cause__``. The trainer's state is that of the last completed step.

    Example:
        ```python
        try:
            trainer.fit(data, epochs=3)
        except px.callbacks.TrackerError as error:
            print(error)  # e.g. "MLflowLogger could not start its run at ..."
            raise error.__cause__  # MLflow's or W&B's own exception
        ```
    """


@contextlib.contextmanager
def tracker_call(who: str, what: str, fix: str) -> Iterator[None]:
    """Raise an exception of the tracker's library inside the block as a
    `TrackerError` saying that `who` could not `what`, then `fix`."""
    try:
        yield
    except Exception as error:
        raise TrackerError(f"{who} could not {what} ({brief(error)}); {fix}") from error


def brief(error: BaseException, limit: int = 300) -> str:
    """`error` on one line: its type and message, whitespace collapsed, at
    most about `limit` characters (its middle left out)."""
    text = " ".join(str(error).split())
    # pydantic (W&B's settings) appends a link to its own error catalogue.
    text = text.split(" For further information visit ")[0]
    if len(text) > limit:  # its start says what failed, its end why
        text = f"{text[: limit // 2].rstrip()} ... {text[-limit // 2 :].lstrip()}"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
