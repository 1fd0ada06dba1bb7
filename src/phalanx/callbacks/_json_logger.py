import json
import math
import numbers
import os
from typing import IO, Any

from typing_extensions import override

from .._typing import validates_own_arguments
from ._callback import Callback, StepInfo
from ._csv_logger import check_file_path, check_log_every, log_row, replace_atomically


class JSONLogger(Callback):
    """Writes metrics as JSON Lines: an object per logged step and per epoch.

    Each line is ``{"kind": "step" | "epoch", "step": ..., "epoch": ...,
    <metric>: ...}`` with the same content as `CSVLogger`'s rows: the step's
    own metrics every `log_every` steps; the epoch's train means and
    ``eval_*`` results at each epoch end; values earlier callbacks add.

    The output is standard JSON (``json.loads`` and other languages' parsers
    read it): a non-finite float, which JSON cannot represent, is written as
    the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, so ``float(v)``
    in Python (or ``Number(v)`` in JavaScript) reads every metric back.

    Each line is one flushed write, so a crash leaves complete lines only.
    The first `fit` starts a new file (replacing any old one); later fits of
    the same logger append. For an exact resume, save `state_dict` with the
    model checkpoint and `load_state_dict` it into a new logger: its first fit
    drops the lines written after the checkpoint.

    Example:
        ```python
        logger = px.callbacks.JSONLogger("metrics.jsonl", log_every=50)
        trainer = px.DataParallelTrainer(model, optax.adam(1e-3), callbacks=[logger])
        trainer.fit(data, epochs=3, eval_data=test)
        rows = [json.loads(line) for line in open("metrics.jsonl")]
        ```
    """

    @validates_own_arguments
    def __init__(self, path: str | os.PathLike[str], *, log_every: int = 10):
        """Args:
        path: the JSON Lines file; its folder must exist.
        log_every: write a step line after every this many steps.

        Raises:
            ValueError: `log_every` is not a positive int.
            TypeError: `path` is not a str or path.
            FileNotFoundError, NotADirectoryError, IsADirectoryError,
                PermissionError: `path` cannot be written.
        """
        self.path = check_file_path(path, "path", example="metrics.jsonl")
        self.log_every = check_log_every(log_every)
        # Complete lines in the file; None until the first fit starts a file.
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
        """Lines written and the step of the last one."""
        return {"rows": self._rows, "last_step": self._last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`; the next fit keeps only the lines it counts."""
        self._close()
        self._rows = state["rows"]
        self._last_step = state["last_step"]

    # ----------------------------------------------------------- internals

    def _open(self) -> None:
        if self._file is not None:
            return
        lines = [] if self._rows is None else self._read()[: self._rows]
        self._rows = len(lines)
        text = "".join(lines).encode("utf-8")
        replace_atomically(self.path, lambda file: file.write(text))
        self._file = open(self.path, "a", encoding="utf-8")

    def _close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def _read(self) -> list[str]:
        """The file's complete lines (a line cut short by a crash is dropped)."""
        try:
            with open(self.path, encoding="utf-8") as file:
                lines = file.readlines()
        except FileNotFoundError:
            return []
        return [line for line in lines if line.endswith("\n")]

    def _write(self, row: dict[str, Any]) -> None:
        self._open()
        assert self._file is not None and self._rows is not None
        encoded = {name: _json_value(value) for name, value in row.items()}
        self._file.write(json.dumps(encoded, allow_nan=False) + "\n")
        self._file.flush()
        self._rows += 1
        self._last_step = row["step"]


def _json_value(value: Any) -> Any:
    """Numbers as JSON numbers; a non-finite float as "NaN"/"Infinity"/"-Infinity"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    number = float(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "Infinity" if number > 0 else "-Infinity"
    return number
