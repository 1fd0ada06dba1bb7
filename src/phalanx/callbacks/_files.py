"""Files the callbacks write: a path checked when the callback is made, a
file replaced all or nothing, and a logger's row.

Nothing here opens a file for longer than a call, or knows a file format.
"""

import os
import pathlib
from typing import Any

from ._base import StepInfo


def log_row(kind: str, info: StepInfo) -> dict[str, Any]:
    """``kind``, ``step``, ``epoch``, then the metrics (read at this point)."""
    row: dict[str, Any] = {"kind": kind, "step": info.step, "epoch": info.epoch}
    for name, value in info.metrics.items():
        row.setdefault(name, value)
    return row


def check_file_path(
    path: object, name: str, *, directory: bool = False, example: str = ""
) -> pathlib.Path:
    """`path` as a Path, if it can be written: a file (or with `directory`, a
    folder) or not there yet, in a folder that is writable or can be made
    (it is made when the first file is written, as `Checkpoint` does)."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"{name}={path!r} must be a str or os.PathLike path, "
            f"not {type(path).__name__}"
        )
    file = pathlib.Path(path)
    if directory and file.exists() and not file.is_dir():
        raise NotADirectoryError(
            f"{name}={str(path)!r} is a file; pass a folder (new or existing) "
            "for the logs"
        )
    if not directory and file.is_dir():
        raise IsADirectoryError(
            f"{name}={str(path)!r} is a folder; pass a file path, "
            f"e.g. {str(file / example)!r}"
        )
    parent = file.absolute().parent
    while not parent.exists():  # the folder that would hold the new ones
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(
            f"{name}={str(path)!r}: {str(parent)!r} is a file, so no folder can "
            "be made there; pass a path under a folder"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(
            f"{name}={str(path)!r}: folder {str(parent)!r} is not writable; "
            "pass a path in a folder you can write to"
        )
    return file
