"""W&B's transaction log, a run's ``.wandb`` file, read back: what a
resumed `WandbLogger` needs to know of the run's earlier parts, without a
server (offline).

The format: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
LevelDB log records in 32 KiB blocks, each a CRC-32, a length and a type
(a whole record, or its first, middle or last part) before its data; a
whole record's data is one protobuf ``wandb_internal_pb2.Record``.
"""

import os
import pathlib
import struct
import time
import zlib
from collections.abc import Iterator
from typing import Any

from .._log import logger


_BLOCK = 32768
_HEADER = struct.Struct("<4sHB")
_RECORD = struct.Struct("<IHB")
_MAGIC = (b":W&B", 0xBEE1, 0)
_WHOLE, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def transaction_log(path: pathlib.Path, *, tail: int | None = None) -> Iterator[Any]:
    """The protobuf `Record`s of a W&B ``.wandb`` file, in order (with
    `tail`, those that begin in the blocks of its last `tail` bytes); a torn
    record at the end (a process that died writing it) ends them.

    Raises:
        ValueError: the file is not a transaction log of a known version.
    """
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as file:
        header = file.read(_HEADER.size)
        if len(header) < _HEADER.size or _HEADER.unpack(header) != _MAGIC:
            raise ValueError("not a W&B transaction log of version 0")
        size = file.seek(0, os.SEEK_END)
        start = 0 if tail is None else max(size - tail, 0) // _BLOCK * _BLOCK
        file.seek(start)
        data = file.read()
    # The parts of the record being read; None before a first part is seen.
    offset, parts = max(start, _HEADER.size) - start, None
    while True:
        if _BLOCK - offset % _BLOCK < _RECORD.size:  # the block's zero padding
            offset += _BLOCK - offset % _BLOCK
        if offset + _RECORD.size > len(data):
            return
        crc, length, kind = _RECORD.unpack_from(data, offset)
        offset += _RECORD.size
        chunk = data[offset : offset + length]
        offset += length
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            return
        if kind in (_WHOLE, _FIRST):
            parts = chunk
        elif parts is not None and kind in (_MIDDLE, _LAST):
            parts += chunk
        if kind in (_WHOLE, _LAST) and parts is not None:
            # Generated protobuf classes are invisible to static checkers.
            record = wandb_internal_pb2.Record()  # pyright: ignore[reportAttributeAccessIssue]
            try:
                record.ParseFromString(parts)
            except DecodeError as error:
                raise ValueError(f"damaged record at byte {start + offset}") from error
            yield record
            parts = None


def history_steps(path: pathlib.Path) -> Iterator[int]:
    """The step of each history row in a W&B ``.wandb`` file."""
    for record in transaction_log(path):
        if record.HasField("history"):
            yield record.history.step.num


def last_step_on_disk(wandb_dir: pathlib.Path, this: pathlib.Path) -> int:
    """The last step in a run's other local parts (-1 if none): the
    transaction logs in `wandb_dir` named as `this` one (the part being
    written), those of the run's earlier fits on this machine."""
    last = -1
    for folder in wandb_dir.iterdir():
        path = folder / this.name
        # "latest-run" links to one of the folders: read each part once.
        if folder.is_symlink() or path == this or not path.is_file():
            continue
        try:
            last = max(last, max(history_steps(path), default=-1))
        except (OSError, ValueError) as error:
            logger.warning(
                f"WandbLogger: cannot read {path} ({error}); steps it holds past "
                "the checkpoint may be logged again"
            )
    return last


def wait_until_written(path: pathlib.Path, timeout: float = 10.0) -> None:
    """Wait until W&B has written a finished run's exit record to `path`:
    `Run.finish` returns before W&B's service has written it (wandb 0.31),
    and the next fit reads the file."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            records = transaction_log(path, tail=2 * _BLOCK)
            if any(record.HasField("exit") for record in records):
                return
        except (OSError, ValueError):
            pass  # not written yet
        time.sleep(0.005)
    logger.warning(
        f"WandbLogger: W&B has not finished writing {path} after {timeout:g} s; "
        "a fit resuming its run may log its last steps again"
    )
