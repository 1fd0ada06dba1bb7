"""`RowLogger`: what `CSVLogger` and `JSONLogger` share, once: when a row is
written, that each is one flushed write, and how a resumed logger drops the
rows written after its checkpoint.

A subclass says only how its file format reads, rewrites and appends rows;
it may not write anything but whole rows.
"""

import abc
import os
from typing import IO, Any, ClassVar, Generic, TypeVar

from typing_extensions import override

from .._typing import validates_own_arguments
from .._validate import positive_int
from ._arrays import numbers_only
from ._base import StepInfo
from ._files import check_file_path, log_row
from ._output import Output


# A row as the file holds it (a CSV row's cells, a JSON line).
_Row = TypeVar("_Row")


class RowLogger(Output, Generic[_Row]):
    """Writes a row per logged step and per epoch to a file, crash-safely.

    Rows come from `log_row`: a step row every `log_every` steps, an epoch
    row at each epoch end, and an eval row at each of ``fit(eval_every=)``'s
    evaluations (evaluations at epoch ends are in the epoch's row). Each row
    is one flushed write, so a crash leaves complete rows only. The first
    `fit` starts a new file (replacing any old one); later fits append.
    `state_dict` counts the rows written, so a logger restored with
    `load_state_dict` drops the rows written after the checkpoint when its
    first fit reopens the file.

    Subclasses say how the file is read (`_read`), rewritten and reopened
    (`_reopen`), appended to (`_append`), and what else a resume needs
    (`_extra_state`, `_load_extra_state`).
    """

    # A file name for the examples in error messages, e.g. "metrics.csv".
    _example: ClassVar[str]
    # Whether the format writes a metric that is an array (a confusion
    # matrix); if not, it is left out, and said once.
    _writes_arrays: ClassVar[bool]

    @validates_own_arguments
    def __init__(self, path: str | os.PathLike[str], *, log_every: int = 10):
        """
        Args:
            path: the file; its folder is created if needed. Nothing is
                written until the first fit.
            log_every: write a step row after every this many steps.

        Raises:
            ValueError: `log_every` is not a positive int.
            TypeError: `path` is not a str or path.
            NotADirectoryError, IsADirectoryError, PermissionError: `path`
                cannot be written.
        """
        self.path = check_file_path(path, "path", example=self._example)
        self.log_every = positive_int("log_every", log_every, example="log_every=10")
        # Complete rows in the file; None until the first fit starts a file.
        self._rows: int | None = None
        self._last_step: int | None = None
        self._file: IO[str] | None = None
        self._load_extra_state(None)

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        del info
        self._open()

    @override
    def on_step_end(self, info: StepInfo) -> None:
        if info.step % self.log_every == 0:
            self._write(log_row("step", info))

    @override
    def on_eval_end(self, info: StepInfo) -> None:
        if info.eval_every is not None:
            self._write(log_row("eval", info))

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        self._write(log_row("epoch", info))

    def state_dict(self) -> dict[str, Any]:
        """Rows written, the step of the last one, and what the format keeps."""
        return {
            "rows": self._rows,
            **self._extra_state(),
            "last_step": self._last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`; the next fit keeps only the rows it counts."""
        self._close()
        self._rows = state["rows"]
        self._load_extra_state(state)
        self._last_step = state["last_step"]

    # ----------------------------------------------------------- internals

    def _open(self) -> None:
        if self._file is not None:
            return
        # A new file, or the rows this logger has written (dropping any after
        # a restored checkpoint): always a complete file before appending.
        rows = [] if self._rows is None else self._read()[: self._rows]
        self._rows = len(rows)
        self._file = self._reopen(rows)

    @override
    def _close(self, error: BaseException | None = None) -> None:
        del error
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def _write(self, row: dict[str, Any]) -> None:
        if not self._writes_arrays:
            row = numbers_only(row)
        self._open()
        assert self._file is not None and self._rows is not None
        self._append(self._file, row)
        self._rows += 1
        self._last_step = row["step"]

    @abc.abstractmethod
    def _read(self) -> list[_Row]:
        """The file's complete rows; none if there is no file."""

    @abc.abstractmethod
    def _reopen(self, rows: list[_Row]) -> IO[str]:
        """Replace the file atomically with `rows` only, then open it to append."""

    @abc.abstractmethod
    def _append(self, file: IO[str], row: dict[str, Any]) -> None:
        """Write `row` to the open `file` as one flushed write.

        May instead rewrite the file with `row` included (through `_reopen`,
        leaving the new file in ``self._file``) when it cannot be appended.
        """

    @abc.abstractmethod
    def _extra_state(self) -> dict[str, Any]:
        """What `state_dict` holds besides the row count and last step."""

    @abc.abstractmethod
    def _load_extra_state(self, state: dict[str, Any] | None) -> None:
        """Restore what `_extra_state` returned, from the whole `state`;
        None: set up a new logger's."""
