import csv
import io
import os
import pathlib
import secrets
from collections.abc import Callable
from typing import IO, Any

from typing_extensions import override

from .._typing import validates_own_arguments
from ._callback import Callback, StepInfo


_KEYS = ("kind", "step", "epoch")


class CSVLogger(Callback):
    """Writes metrics to a CSV file: a row per logged step and per epoch.

    Columns are ``kind`` (``"step"`` or ``"epoch"``), ``step`` (updates made
    so far), ``epoch`` (from 0), then each metric in the order first seen:
    the step's own metrics every `log_every` steps; the epoch's train means
    and ``eval_*`` results at each epoch end; values earlier callbacks add
    (e.g. ``lr``). A cell a row lacks is empty. Floats are written exactly
    (``repr``), ``nan`` and ``inf`` as Python spells them, so `float` reads
    every cell back.

    Crash safety: each row is one flushed write, and when a new column appears
    the file is rewritten with the wider header into a temporary file that
    then replaces it atomically; a crash leaves complete rows only.

    The first `fit` starts a new file (replacing any old one); later fits of
    the same logger append. For an exact resume, save `state_dict` with the
    model checkpoint (with checkpointing after the loggers in the callback
    list) and `load_state_dict` it into a new logger: its first fit drops the
    rows written after the checkpoint.

    Logging reads the step's metrics, which waits for the device, so a large
    `log_every` keeps the device queue full.

    Example:
        ```python
        logger = px.callbacks.CSVLogger("metrics.csv", log_every=50)
        trainer = px.DataParallelTrainer(model, optax.adam(1e-3), callbacks=[logger])
        trainer.fit(data, epochs=3, eval_data=test)
        rows = list(csv.DictReader(open("metrics.csv")))
        ```
    """

    @validates_own_arguments
    def __init__(self, path: str | os.PathLike[str], *, log_every: int = 10):
        """Args:
        path: the CSV file; its folder must exist.
        log_every: write a step row after every this many steps.

        Raises:
            ValueError: `log_every` is not a positive int.
            TypeError: `path` is not a str or path.
            FileNotFoundError, NotADirectoryError, IsADirectoryError,
                PermissionError: `path` cannot be written.
        """
        self.path = check_file_path(path, "path", example="metrics.csv")
        self.log_every = check_log_every(log_every)
        self._columns: list[str] = list(_KEYS)
        # Complete data rows in the file; None until the first fit starts a file.
        self._rows: int | None = None
        self._last_step: int | None = None
        self._file: IO[str] | None = None

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        del info
        self._open()

    @override
    def on_step_end(self, info: StepInfo) -> None:
        if info.step % self.log_every == 0:
            self._write(log_row("step", info))

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        self._write(log_row("epoch", info))

    @override
    def on_fit_end(self, info: StepInfo) -> None:
        del info
        self._close()

    @override
    def on_exception(self, info: StepInfo, error: BaseException) -> None:
        del info, error
        self._close()

    def state_dict(self) -> dict[str, Any]:
        """Rows written, the header, and the step of the last row."""
        return {
            "rows": self._rows,
            "columns": list(self._columns),
            "last_step": self._last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`; the next fit keeps only the rows it counts."""
        self._close()
        self._rows = state["rows"]
        self._columns = list(state["columns"])
        self._last_step = state["last_step"]

    # ----------------------------------------------------------- internals

    def _open(self) -> None:
        if self._file is not None:
            return
        # A new file, or the rows this logger has written (dropping any after
        # a restored checkpoint): always a complete file before appending.
        rows = [] if self._rows is None else self._read()[: self._rows]
        self._rows = len(rows)
        self._rewrite(rows)
        self._file = open(self.path, "a", newline="", encoding="utf-8")

    def _close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def _read(self) -> list[dict[str, str]]:
        try:
            with open(self.path, newline="", encoding="utf-8") as file:
                reader = csv.DictReader(file)
                rows = list(reader)
                header = reader.fieldnames or []
        except FileNotFoundError:
            return []
        self._columns.extend(c for c in header if c not in self._columns)
        return rows

    def _write(self, row: dict[str, Any]) -> None:
        self._open()
        assert self._file is not None and self._rows is not None
        if any(name not in self._columns for name in row):
            self._file.close()
            self._file = None
            rows = self._read()[: self._rows]
            self._columns.extend(name for name in row if name not in self._columns)
            self._rewrite([*rows, row])
            self._file = open(self.path, "a", newline="", encoding="utf-8")
        else:
            self._file.write(self._format([row], header=False))
            self._file.flush()
        self._rows += 1
        self._last_step = row["step"]

    def _format(self, rows: list[dict[str, Any]], *, header: bool) -> str:
        buffer = io.StringIO()
        writer = csv.DictWriter(
            buffer,
            self._columns,
            restval="",
            extrasaction="ignore",
            lineterminator="\n",
        )
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue()

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        text = self._format(rows, header=True).encode("utf-8")
        replace_atomically(self.path, lambda file: file.write(text))


# ------------------------------------------------- shared by the file loggers


def log_row(kind: str, info: StepInfo) -> dict[str, Any]:
    """``kind``, ``step``, ``epoch``, then the metrics (read at this point)."""
    row: dict[str, Any] = {"kind": kind, "step": info.step, "epoch": info.epoch}
    for name, value in info.metrics.items():
        row.setdefault(name, value)
    return row


def check_log_every(log_every: object) -> int:
    """`log_every` if a positive int, else a ValueError saying so (as the
    trainer's ``sync_every`` and the other callbacks do)."""
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
        raise ValueError(
            f"log_every={log_every!r} must be an int >= 1 (the steps between "
            "log rows), e.g. log_every=10"
        )
    return log_every


def check_file_path(
    path: object, name: str, *, directory: bool = False, example: str = ""
) -> pathlib.Path:
    """`path` as a Path, if its folder exists and is writable (and it is a file,
    or with `directory`, a folder or not there yet)."""
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
    parent = file.parent
    if not parent.is_dir():
        raise FileNotFoundError(
            f"{name}={str(path)!r}: its folder {str(parent)!r} does not exist; "
            f"create it first (os.makedirs({str(parent)!r}, exist_ok=True))"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(
            f"{name}={str(path)!r}: its folder {str(parent)!r} is not writable; "
            "pass a path in a folder you can write to"
        )
    return file


def replace_atomically(
    path: pathlib.Path, write: Callable[[IO[bytes]], object]
) -> None:
    """Replace `path` with what `write` writes, all or nothing: a temporary
    file in the same folder, flushed and synced, then `os.replace`."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "xb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if os.name == "posix":
        # The rename itself survives a power cut only once the folder is synced.
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
