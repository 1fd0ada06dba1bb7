"""What went wrong with a checkpoint on disk, said in one line.

Orbax and TensorStore report a full disk, a folder that turned read-only or a
truncated file with several exception types, long chains of them, and
messages that embed whole TensorStore specs. A user needs what failed, where,
and what to do; the original error stays attached as ``__cause__``.
"""

import errno
import gc
import logging
import os
import re
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (no space left, a folder that is not
    writable, a file size limit, ...). The checkpoints completed before it
    are intact; ``errno`` is the operating system's code where one is known,
    and ``__cause__`` the original error."""


# Shown as phalanx.checkpoint.CheckpointWriteError, where users import it from.
CheckpointWriteError.__module__ = "phalanx.checkpoint"


# The errno a failure carries, and how to say it: (what failed, what to do).
_WRITE_FAILURES = {
    errno.ENOSPC: ("no space left on the device", "free space on that disk"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space or raise the quota"),
    errno.EFBIG: (
        "a file grew past the process's file size limit (ulimit -f)",
        "raise the limit (ulimit -f unlimited)",
    ),
    errno.EACCES: (
        "the folder is not writable (permission denied)",
        "make it writable (chmod u+w)",
    ),
    errno.EPERM: (
        "the folder is not writable (operation not permitted)",
        "make it writable (chmod u+w; chattr -i if it is immutable)",
    ),
    errno.EROFS: ("the file system is read-only", "remount it read-write"),
}
# TensorStore's note of the operating system's error code, e.g.
# "Failed to write 6207 bytes to file 4: File too large [os_error_code='27']".
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_TRUNCATED = re.compile(r"is not valid for value of size \d+")
# Where TensorStore starts dumping a spec into a message.
_DUMP = re.compile(r"\s*(See full TensorStore details|TensorStore\(\{|\{\s*\").*", re.S)


def causes(error: BaseException) -> list[BaseException]:
    """`error` and every error behind it (``__cause__``, else ``__context__``)."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def os_error_code(error: BaseException) -> int | None:
    """The operating system's error code behind `error`, if any says one."""
    for cause in causes(error):
        if isinstance(cause, OSError) and cause.errno is not None:
            return cause.errno
        match = _OS_ERROR_CODE.search(str(cause))
        if match:
            return int(match.group(1))
    return None


def summary(error: BaseException, limit: int = 200) -> str:
    """The innermost readable message behind `error`: one line, at most
    `limit` characters, without TensorStore's spec dumps."""
    code = os_error_code(error)
    if code is not None:
        return f"{os.strerror(code)} (errno {code})"
    chain = causes(error)
    if any(_TRUNCATED.search(str(cause)) for cause in chain):
        return "a file in it is shorter than its index says (truncated)"
    for cause in reversed(chain):
        text = _DUMP.sub("", str(cause)).strip().splitlines()
        if text and text[0].strip():
            line = f"{type(cause).__name__}: {text[0].strip()}"
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return type(error).__name__


def write_error(
    error: BaseException, directory: Path, step: int, kept: list[int]
) -> CheckpointWriteError:
    """One clear error for a failed save of `step` into `directory`."""
    code = os_error_code(error)
    what, fix = _WRITE_FAILURES.get(
        code or -1, (summary(error), "check the disk and the folder")
    )
    intact = (
        f"the complete checkpoints are intact (newest: step {max(kept)})"
        if kept
        else "no complete checkpoint was written before it"
    )
    failure = CheckpointWriteError(
        f"Checkpoint: saving step {step} into {directory} failed: {what}. "
        f"Training stopped; {intact}. To continue, {fix} or pass another "
        "Checkpoint directory, then run again with resume='latest'"
    )
    failure.errno = code
    return failure


def release_failed_io(failure: BaseException | None) -> None:
    """Let the writes or reads of a failed save or restore end now, while
    the interpreter runs.

    The frames of the errors behind `failure` hold orbax's unfinished
    coroutines; finalised at the interpreter's exit instead, each prints an
    error. Their local variables are cleared (`traceback.clear_frames`; the
    frames themselves stay, for the traceback), then collected.
    """
    if failure is None:
        return
    for cause in causes(failure):
        traceback.clear_frames(cause.__traceback__)
    with warnings.catch_warnings():
        # Coroutines orbax made for the failed read or write but never
        # started warn as they are collected; the failure is raised already.
        warnings.filterwarnings(
            "ignore", "coroutine .* was never awaited", RuntimeWarning
        )
        gc.collect()


class OrbaxErrorFilter(logging.Filter):
    """Drops the error logs of a failed orbax save or read: orbax's own (a
    traceback per background thread, often hundreds of lines for one full
    disk), and asyncio's note of an orbax write whose error nobody took
    ("exception was never retrieved"). phalanx raises each such failure
    itself, in one line, with orbax's error as its cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if "/orbax/" in record.pathname:
            return False
        error = record.exc_info[1] if record.exc_info else None
        return not (
            isinstance(error, BaseException)
            and any(
                "/orbax/" in frame.filename
                for cause in causes(error)
                for frame in traceback.extract_tb(cause.__traceback__)
            )
        )


_FILTER = OrbaxErrorFilter()


def _orbax_cleanup(unraisable: Any) -> bool:
    """Whether an unraisable error is orbax's clean-up after a failed save or
    read: a write finishing after orbax closed the event loop waiting for it
    (TensorStore then cannot wake the loop, and says so), or one of orbax's
    unfinished coroutines failing again as it is collected."""
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None and "/orbax/" in code.co_filename:
        return True
    frames = traceback.extract_tb(unraisable.exc_traceback)
    return (
        unraisable.exc_type is RuntimeError
        and str(unraisable.exc_value) == "Event loop is closed"
        and bool(frames)
        and frames[-1].name == "_check_closed"
        and "asyncio" in frames[-1].filename
    )


def quiet_orbax_errors() -> None:
    """Keep orbax's reports of a failed save or read off the screen (phalanx
    raises the failure itself, in one line): its error logs, and the errors
    of its clean-up (`_orbax_cleanup`). Installed once; everything else
    passes through."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    previous = sys.unraisablehook
    if getattr(previous, "__name__", "") == "_unraisable_hook":
        return

    def _unraisable_hook(unraisable: Any) -> None:
        if not _orbax_cleanup(unraisable):
            previous(unraisable)

    sys.unraisablehook = _unraisable_hook
