"""Writing a file all or nothing (`replace_atomically`): a timeline's
record, and the loggers' and plots' files (the callbacks import it from
here, the lowest layer that writes files)."""

import os
import pathlib
import secrets
from collections.abc import Callable
from typing import IO


def replace_atomically(
    path: pathlib.Path, write: Callable[[IO[bytes]], object], *, sync: bool = True
) -> None:
    """Replace `path` with what `write` writes, all or nothing: a temporary
    file in the same folder, flushed and (with `sync`) synced to the disk,
    then `os.replace`. Unsynced, the file survives the process being killed,
    not the machine losing power."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "xb") as file:
            write(file)
            file.flush()
            if sync:
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if sync and os.name == "posix":
        # The rename itself survives a power cut only once the folder is synced.
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
