import csv
import io
import os
from typing import IO, Any, final

from typing_extensions import override

from .._typing import validates_own_arguments
from ._files import replace_atomically
from ._row_logger import RowLogger


_KEYS = ("kind", "step", "epoch")


@final
class CSVLogger(RowLogger[dict[str, Any]]):
    """Writes metrics to a CSV file: a row per logged step and per epoch.

    Columns are ``kind`` (``"step"``, ``"epoch"`` or ``"eval"``), ``step``
    (updates made so far), ``epoch`` (from 0), then each metric in the order
    first seen: the step's own metrics every `log_every` steps; the epoch's
    train means and ``eval_*`` results at each epoch end; with
    ``fit(eval_every=N)``, an ``"eval"`` row of the ``eval_*`` results after
    every N-th step instead; values earlier callbacks add (e.g. ``lr``). A
    cell a row lacks is empty. Floats are written exactly (``repr``),
    ``nan`` and ``inf`` as Python spells them, so `float` reads every cell
    back.

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
        """
        Args:
            path: the CSV file; its folder is created if needed.
            log_every: write a step row after every this many steps.

        Raises:
            ValueError: `log_every` is not a positive int.
            TypeError: `path` is not a str or path.
            NotADirectoryError, IsADirectoryError, PermissionError: `path`
                cannot be written.
        """
        super().__init__(path, log_every, example="metrics.csv")
        self._columns: list[str] = list(_KEYS)

    @override
    def _read(self) -> list[dict[str, Any]]:
        """The file's rows; its header extends the columns."""
        try:
            with open(self.path, newline="", encoding="utf-8") as file:
                reader = csv.DictReader(file)
                rows: list[dict[str, Any]] = list(reader)
                header = reader.fieldnames or []
        except FileNotFoundError:
            return []
        self._columns.extend(c for c in header if c not in self._columns)
        return rows

    @override
    def _reopen(self, rows: list[dict[str, Any]]) -> IO[str]:
        text = self._format(rows, header=True).encode("utf-8")
        replace_atomically(self.path, lambda file: file.write(text))
        return open(self.path, "a", newline="", encoding="utf-8")

    @override
    def _append(self, file: IO[str], row: dict[str, Any]) -> None:
        if all(name in self._columns for name in row):
            file.write(self._format([row], header=False))
            file.flush()
            return
        # A new column: rewrite the file under the wider header.
        file.close()
        self._file = None
        rows = self._read()[: self._rows]
        self._columns.extend(name for name in row if name not in self._columns)
        self._file = self._reopen([*rows, row])

    @override
    def _extra_state(self) -> dict[str, Any]:
        return {"columns": list(self._columns)}

    @override
    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self._columns = list(state["columns"])

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
