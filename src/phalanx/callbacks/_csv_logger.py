"""`px.callbacks.CSVLogger`: a run's metrics as rows of a CSV file.

When rows are written, and how a resume drops those past its checkpoint, is
`RowLogger`'s; this module is the CSV format: a header that widens (the
file rewritten atomically) when a new metric appears, and floats written
exactly.
"""

import csv
import io
from typing import IO, Any, final

from typing_extensions import override

from .._telemetry._files import replace_atomically
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

    _example = "metrics.csv"
    _writes_arrays = False
    _columns: list[str]

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
    def _load_extra_state(self, state: dict[str, Any] | None) -> None:
        self._columns = list(_KEYS if state is None else state["columns"])

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
