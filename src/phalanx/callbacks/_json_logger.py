"""`px.callbacks.JSONLogger`: a run's metrics as JSON Lines, one object a
row.

When rows are written, and how a resume drops those past its checkpoint, is
`RowLogger`'s; this module is the format: standard JSON that any parser
reads, a non-finite float spelled as a string.
"""

import json
import math
import numbers
from typing import IO, Any, final

import numpy as np
from typing_extensions import override

from .._telemetry._files import replace_atomically
from .._validate import is_real
from ._row_logger import RowLogger


@final
class JSONLogger(RowLogger[str]):
    """Writes metrics as JSON Lines: an object per logged step and per epoch.

    Each line is ``{"kind": "step" | "epoch" | "eval", "step": ...,
    "epoch": ..., <metric>: ...}`` with the same content as `CSVLogger`'s
    rows: the step's own metrics every `log_every` steps; the epoch's train
    means and ``eval_*`` results at each epoch end (with
    ``fit(eval_every=N)``: an ``"eval"`` line after every N-th step
    instead); values earlier callbacks add.

    The output is standard JSON (``json.loads`` and other languages' parsers
    read it): a non-finite float, which JSON cannot represent, is written as
    the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, so ``float(v)``
    in Python (or ``Number(v)`` in JavaScript) reads every metric back. A
    metric that is an array (a confusion matrix) is written as nested lists.

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

    _example = "metrics.jsonl"
    _writes_arrays = True

    @override
    def _read(self) -> list[str]:
        """The file's complete lines (a line cut short by a crash is dropped)."""
        try:
            with open(self.path, encoding="utf-8") as file:
                lines = file.readlines()
        except FileNotFoundError:
            return []
        return [line for line in lines if line.endswith("\n")]

    @override
    def _reopen(self, rows: list[str]) -> IO[str]:
        text = "".join(rows).encode("utf-8")
        replace_atomically(self.path, lambda file: file.write(text))
        return open(self.path, "a", encoding="utf-8")

    @override
    def _append(self, file: IO[str], row: dict[str, Any]) -> None:
        encoded = {name: _json_value(value) for name, value in row.items()}
        file.write(json.dumps(encoded, allow_nan=False) + "\n")
        file.flush()

    @override
    def _extra_state(self) -> dict[str, Any]:
        return {}

    @override
    def _load_extra_state(self, state: dict[str, Any] | None) -> None:
        del state


def _json_value(value: Any) -> Any:
    """Numbers as JSON numbers; a non-finite float as "NaN"/"Infinity"/"-Infinity";
    an array as nested lists of those."""
    if isinstance(value, np.ndarray):
        return [_json_value(item) for item in value.tolist()]
    if isinstance(value, list):
        return [_json_value(item) for item in value]
    if not is_real(value):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    number = float(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "Infinity" if number > 0 else "-Infinity"
    return number
