"""The progress bar's table of epochs: which columns it has, their headings
and widths, and how it keeps within `WIDTH` characters however many
evaluation sets and metrics a fit has.

An epoch's metrics are one row (the epoch, the training metrics, examples
per second, each evaluation's metrics, the time) while that row fits. When
it does not (several evaluation sets, or many metrics), each evaluation set
gets a row of its own under the epoch's, in the training metrics' columns;
metrics that still do not fit are left out, named once under the heading.
It formats text only: the progress bar prints it.
"""

import dataclasses
import math
from collections.abc import Mapping, Sequence


WIDTH = 100  # characters a line of the table may take
_GAP = "  "
# Headings where they are not the metric's own name.
_HEADINGS = {"eval_loss": "eval loss", "eval_accuracy": "eval acc"}
# Not columns of their own: Throughput's rates are the "ex/s" column (its
# FLOPs per second and utilisation are in the history and the loggers').
_HIDDEN = ("examples_per_sec", "steps_per_sec", "tflops_per_sec", "mfu")
_LAST = ("ex/s", "time")  # the progress bar's own columns, at the row's end


@dataclasses.dataclass(frozen=True)
class EpochTable:
    """The table's layout for an epoch's metrics.

    Attributes:
        columns: the metric columns. One row per epoch: the keys of the
            epoch's metrics (``eval_`` ones included). A row per set: the
            metric names the sets share with training (``loss``, ...).
        sets: with a row per set, each set's label and its metrics' keys
            by column (``("val", {"loss": "eval_val_loss", ...})``); else
            empty.
        left_out: the metrics not shown, for width.
        first: the width of the first column (the epoch, or a set's label).
    """

    columns: tuple[str, ...]
    sets: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    left_out: tuple[str, ...] = ()
    first: int = 7

    @classmethod
    def of(cls, values: Mapping[str, float]) -> "EpochTable":
        """The layout for an epoch's `values` (scalars, with ``ex/s`` and
        ``time``): one row if it fits `WIDTH`, else a row per set."""
        shown = [
            name
            for name in values
            if name not in (*_HIDDEN, *_LAST)
            and name != "goodput"  # (Timeline's: its own table's)
            and not name.startswith("time/")
        ]
        train = _loss_first([n for n in shown if not n.startswith("eval_")])
        evals = [n for n in shown if n.startswith("eval_")]
        wide = cls((*train, "ex/s", *_loss_first(evals), "time"))
        if wide.width() <= WIDTH:
            return wide
        sets = _by_set(evals, train)
        extra = [m for _, keys in sets for m in keys if m not in train]
        columns = [*train, *dict.fromkeys(extra)]
        first = max([7, *(len(label) for label, _ in sets)])
        left_out: list[str] = []
        while True:
            table = cls(
                (*columns, *_LAST),
                tuple((label, tuple(keys.items())) for label, keys in sets),
                tuple(left_out),
                first,
            )
            if table.width() <= WIDTH or len(columns) <= 1:
                return table
            left_out.insert(0, columns.pop())  # the last-listed goes first

    def width(self) -> int:
        """The characters of a row."""
        widths = [self.first, *(_width(c) for c in self.columns)]
        return sum(widths) + len(_GAP) * (len(widths) - 1)

    def heading(self) -> str:
        return _GAP.join(
            [
                f"{'epoch':>{self.first}}",
                *(f"{self._heading(c):>{_width(c)}}" for c in self.columns),
            ]
        )

    def note(self) -> str | None:
        """The line under the heading naming the metrics left out, if any."""
        if not self.left_out:
            return None
        return (
            f"(not shown, for width: {', '.join(self.left_out)}; in "
            "trainer.history and the loggers)"
        )

    def rows(self, epoch: str, values: Mapping[str, float]) -> list[str]:
        """The epoch's row (labelled `epoch`) and, with a row per set, each
        set's under it."""
        lines = [self._row(epoch, {c: c for c in self.columns}, values)]
        for label, keys in self.sets:
            lines.append(self._row(label, dict(keys), values))
        return lines

    def _heading(self, column: str) -> str:
        return column if self.sets else column_heading(column)

    def _row(
        self, label: str, keys: dict[str, str], values: Mapping[str, float]
    ) -> str:
        cells = [f"{label:>{self.first}}"]
        for column in self.columns:
            key = keys.get(column)
            text = "" if key is None or key not in values else _cell(key, values[key])
            cells.append(f"{text:>{_width(column)}}")
        return _GAP.join(cells).rstrip()


def evaluation_lines(
    head: str, values: Mapping[str, float], train: Sequence[str]
) -> list[str]:
    """The lines of an evaluation between steps: after `head` (the epoch and
    step), every metric in one line while it fits `WIDTH`, else a line per
    set (`train`: the training metrics' names, to tell sets from metrics)."""
    one = "  ".join(f"{column_heading(k)} {number(v)}" for k, v in values.items())
    if len(f"{head}  {one}") <= WIDTH:
        return [f"{head}  {one}"]
    sets = _by_set(list(values), list(train))
    first = max(len(label) for label, _ in sets)
    return [
        f"{head}  {label:<{first}}  "
        + "  ".join(f"{metric} {number(values[key])}" for metric, key in keys.items())
        for label, keys in sets
    ]


def _loss_first(names: list[str]) -> list[str]:
    first = [name for name in ("loss", "eval_loss") if name in names]
    return sorted(names, key=lambda name: name not in first)


def _by_set(evals: list[str], train: list[str]) -> list[tuple[str, dict[str, str]]]:
    """The evaluation metrics' keys grouped by set, as ``(label, {metric:
    key})``: ``eval_val_f1`` is set ``val``'s ``f1``, ``eval_f1`` the
    unnamed set's (label ``eval``). A key is read as a set and a metric the
    training has (the longest that ends it); others by the sets so found."""
    known = sorted({"loss", *train}, key=len, reverse=True)
    sets: dict[str, dict[str, str]] = {}
    rest = []
    for key in evals:
        name = key.removeprefix("eval_")
        for metric in known:
            if name == metric or name.endswith(f"_{metric}"):
                label = name[: -len(metric) - 1] or "eval"
                sets.setdefault(label, {})[metric] = key
                break
        else:
            rest.append(key)
    for key in rest:  # metrics of evaluations only (an eval_metrics hook's)
        name = key.removeprefix("eval_")
        labels = sorted((s for s in sets if name.startswith(f"{s}_")), key=len)
        label = labels[-1] if labels else "eval"
        metric = name.removeprefix(f"{label}_") if labels else name
        sets.setdefault(label, {})[metric] = key
    return list(sets.items())


def column_heading(column: str) -> str:
    """A metric's heading in the one-row table: ``eval acc``, ``eval val_f1``."""
    return _HEADINGS.get(column, column.replace("eval_", "eval ", 1))


def _width(column: str) -> int:
    # Room for "-1.234e-05" (a value `_number` writes in scientific notation).
    return max(len(column_heading(column)), 7 if column in ("epoch", "time") else 10)


def _cell(column: str, value: float) -> str:
    if column == "ex/s":
        return f"{value:,.0f}"
    if column == "time":
        return f"{value:.2f}s" if value < 10 else f"{value:,.0f}s"
    return number(value)


def number(value: float) -> str:
    """Four decimals, or three significant digits where those would hide it."""
    if value == 0 or 1e-3 <= abs(value) < 1e5 or not math.isfinite(value):
        return f"{value:.4f}"
    return f"{value:.3e}"
