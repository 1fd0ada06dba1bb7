"""What the composition suite asserts of each run: the logged names, the
update against one device's (within the set-up's tolerance), a resume
bitwise, and, on the one-device references, that the average and the
plateau do what they say (so that agreeing with them means something)."""

import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from combinations import (
    BATCH,
    BATCHES,
    DECAY,
    EPOCHS,
    EVAL_EXAMPLES,
    FACTOR,
    STEPS,
    TIMED,
    Combination,
    Net,
    epoch_keys,
    evaluation_keys,
    schedule,
    train_keys,
)
from runs import Outcome, floats, train


# Written by the logger on every line, besides the metrics.
LINE_FIELDS = {"kind", "step", "epoch"}
# Metrics that count examples (a prediction changes them a whole example at
# a time).
COUNTS = ("accuracy", "f1")
# The tolerances of float32 runs: parameters (absolute) and logged values
# (relative), as invariant 1's 1e-5.
FP32_ATOL = FP32_RTOL = 1e-5
# bf16 runs: a logged loss within two bf16 ulps (2**-7 relative: bf16
# keeps 8 significant bits, and the loss is summed from bf16 logits whose
# rounding depends on how the batch is split); a count within 3 examples.
BF16_RTOL = 2.0**-7
BF16_EXAMPLES = 3


class Failures:
    """Makes every check, keeps each failure, and says them together: a run
    that breaks at several seams names each."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def check(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except AssertionError as error:
            self.messages.append(f"{fn.__name__}: {error}")

    def raise_any(self, what: str) -> None:
        if self.messages:
            raise AssertionError(f"{what}:\n" + "\n".join(self.messages))


class References:
    """The one-device runs, each made once (rows that differ only in how
    they run share one), and whether each passes `check_reference`."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.folder = folder
        self.runs: dict[Combination, Outcome] = {}
        self.verdicts: dict[Combination, str] = {}

    def run(self, combo: Combination) -> Outcome:
        if combo not in self.runs:
            self.runs[combo] = train(combo, self.folder / combo.name, record=True)
        return self.runs[combo]

    def check_reference(self, combo: Combination) -> None:
        """`check_reference` on the one-device run of `combo`, made once."""
        if combo not in self.verdicts:
            try:
                check_reference(combo, self.run(combo), self)
                self.verdicts[combo] = ""
            except AssertionError as error:
                self.verdicts[combo] = str(error)
        assert not self.verdicts[combo], self.verdicts[combo]


def timed(name: str) -> bool:
    return name.startswith(TIMED)


def check_names(combo: Combination, run: Outcome, what: str) -> None:
    """The names each epoch, evaluation and logged line has, and the steps
    evaluations ran at."""
    want = epoch_keys(combo)
    for epoch, metrics in enumerate(run.epochs):
        assert set(metrics) == want, (
            f"{what}: epoch {epoch} logged {sorted(metrics)}, expected {sorted(want)}"
        )
    assert len(run.epochs) == EPOCHS, f"{what}: {len(run.epochs)} epochs"
    every = combo.eval_every or BATCHES
    assert [e["step"] for e in run.evaluations] == list(range(every, STEPS + 1, every))
    for evaluation in run.evaluations:
        assert set(evaluation) == evaluation_keys(combo), (
            f"{what}: an evaluation logged {sorted(evaluation)}"
        )
    # The logger writes what the history holds: every callback's additions
    # (the plateau's rate, the timeline's phases) reach it whatever the
    # order of the callbacks.
    epochs = [line for line in run.lines if line["kind"] == "epoch"]
    assert len(epochs) == EPOCHS
    for line, metrics in zip(epochs, run.epochs, strict=True):
        missing = sorted(set(metrics) - set(line))
        assert not missing, f"{what}: the logger's epoch line lacks {missing}"
        assert set(line) - LINE_FIELDS == set(metrics)
        assert {k: line[k] for k in metrics} == metrics
    evals = [line for line in run.lines if line["kind"] == "eval"]
    if combo.eval_every is None:  # at epoch ends: in the epochs' lines
        assert not evals, f"{what}: eval lines without eval_every"
    else:
        assert len(evals) == len(run.evaluations), f"{what}: {len(evals)} eval lines"
        for line, evaluation in zip(evals, run.evaluations, strict=True):
            assert {k: line[k] for k in evaluation} == evaluation
    steps = [line for line in run.lines if line["kind"] == "step"]
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1))
    for line in steps:
        assert set(line) - LINE_FIELDS == train_keys(combo), (
            f"{what}: the logger's line of step {line['step']} has {sorted(line)}"
        )


def check_layout(combo: Combination, run: Outcome) -> None:
    """Every group's optimizer state and the average are laid out as their
    parameters (invariant 9, in every combination)."""
    assert not run.misplaced, f"{combo.name}: " + "; ".join(run.misplaced)


def gap(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The largest absolute difference between two lists of arrays."""
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def averaged(run: Outcome) -> list[np.ndarray]:
    """The parameters, and their average where the run keeps one."""
    return run.params + (run.ema or [])


def check_update(combo: Combination, run: Outcome, references: References) -> None:
    """The run against the one-device run of the same options: the final
    parameters, their average and every logged value (the timings aside:
    each epoch's, each evaluation's and each step's line), within the
    precision's tolerance; the logger's lines in the same order, with the
    same names."""
    reference = references.run(combo.reference())
    if combo.precision == "fp32":
        atol = FP32_ATOL
    else:
        # Two bf16 runs that split the batch differently may each be as far
        # from float32 as the one-device bf16 run is from the one-device
        # float32 run (adam turns a gradient entry that is zero up to
        # rounding into a step of the rate's size, in rounding's direction).
        fp32 = references.run(combo.reference().with_precision("fp32"))
        atol = 2 * gap(averaged(reference), averaged(fp32)) + FP32_ATOL
    found = gap(averaged(run), averaged(reference))
    assert found <= atol, (
        f"{combo.name}: parameters (and average) {found:.3g} from one device's, "
        f"over the tolerance {atol:.3g}"
    )

    def shape(lines: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        return [(line["kind"], line["step"], sorted(line)) for line in lines]

    assert shape(run.lines) == shape(reference.lines), (
        f"{combo.name}: the logger's lines are not one device's (kind, step, names)"
    )
    seen = BATCH * BATCHES  # the examples of an epoch
    records = [
        (f"epoch {i}", seen, run.epochs[i], reference.epochs[i]) for i in range(EPOCHS)
    ]
    records += [
        (f"the evaluation at step {want['step']}", EVAL_EXAMPLES, have, want)
        for have, want in zip(run.evaluations, reference.evaluations, strict=True)
    ]
    records += [
        (f"the line of step {want['step']}", BATCH, have, want)
        for have, want in zip(run.lines, reference.lines, strict=True)
        if want["kind"] == "step"
    ]
    for where, examples, have, want in records:
        for name, value in want.items():
            if timed(name) or name in LINE_FIELDS:
                continue
            tolerance = value_tolerance(combo, name, value, examples)
            diff = abs(have[name] - value)
            assert diff <= tolerance, (
                f"{combo.name}: {where}: {name} = {have[name]!r} where one device "
                f"logs {value!r} (difference {diff:.3g}, tolerance {tolerance:.3g})"
            )


def value_tolerance(
    combo: Combination, name: str, value: float, examples: int
) -> float:
    """How far a logged value, of `examples` examples, may be from one
    device's."""
    if combo.precision == "fp32" or name == "lr":  # the rate: no rounding
        return FP32_RTOL * max(abs(value), 1.0)
    if name.removeprefix("eval_") in COUNTS:
        return BF16_EXAMPLES / examples
    return BF16_RTOL * abs(value)


def check_bitwise(straight: Outcome, resumed: Outcome, name: str) -> None:
    """A run killed and resumed against the one never stopped: every array
    of the state, the history and the logged lines, bit for bit (the
    timings' names, not their values)."""
    assert list(straight.state) == list(resumed.state)
    for path, a in straight.state.items():
        b = resumed.state[path]
        assert a.dtype == b.dtype and np.array_equal(a, b), (
            f"{name}: the resumed state's {path} differs from the straight run's "
            f"by {np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))):.3g}"
        )

    def untimed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: (None if timed(k) else v) for k, v in row.items()} for row in rows]

    for what in ("epochs", "evaluations", "lines"):
        want, have = untimed(getattr(straight, what)), untimed(getattr(resumed, what))
        assert len(have) == len(want), f"{name}: {len(have)} {what}, not {len(want)}"
        for i, (a, b) in enumerate(zip(have, want, strict=True)):
            assert a == b, f"{name}: the resumed run's {what}[{i}] is {a}, not {b}"


def check_reference(combo: Combination, run: Outcome, references: References) -> None:
    """What the one-device run is trusted for: its names; its average is
    the average of its parameters, step by step; and the plateau's
    reductions change the update by the factor (and the logged rate is the
    one used)."""
    failures = Failures()
    failures.check(check_names, combo, run, f"one device, {combo.name}")
    if combo.ema:
        failures.check(check_average, combo, run)
    if combo.plateau:
        plain = references.run(combo.without_plateau())
        failures.check(check_plateau, combo, run, plain)
    failures.raise_any(f"the one-device run of {combo.name}")


def check_average(combo: Combination, run: Outcome) -> None:
    """The average is ``DECAY``'s moving average of the parameters after
    each step, from the initial ones."""
    average = floats(Net(jax.random.key(0)))
    for params in run.trajectory:
        average = [
            DECAY * a + (1 - DECAY) * p for a, p in zip(average, params, strict=True)
        ]
    assert run.ema is not None
    found = gap(run.ema, average)
    assert found <= 1e-6, (
        f"{combo.name}: the average is {found:.3g} from the average of the "
        "parameters after each step"
    )


def check_plateau(combo: Combination, run: Outcome, plain: Outcome) -> None:
    """The plateau reduces the rate at the end of every epoch after the
    first: up to the first reduction the run is the one without it, bit
    for bit; the update after it is `FACTOR` times the one without it from
    the same state; the logged rate is the schedule's times the
    reductions' factor."""
    first = 2 * BATCHES  # the first reduction, at the second epoch's end
    for step in range(first):
        assert gap(run.trajectory[step], plain.trajectory[step]) == 0, (
            f"{combo.name}: with the plateau, step {step + 1} (before any "
            "reduction) differs from the run without it"
        )
    before = run.trajectory[first - 1]
    reduced = [a - b for a, b in zip(run.trajectory[first], before, strict=True)]
    full = [a - b for a, b in zip(plain.trajectory[first], before, strict=True)]
    assert gap(reduced, full) > 0, (
        f"{combo.name}: the plateau reduced the rate at step {first} but the "
        "next update is the one without it (a silent no-op)"
    )
    for have, want in zip(reduced, full, strict=True):
        np.testing.assert_allclose(
            have, FACTOR * want, rtol=1e-5, atol=4e-7, err_msg=combo.name
        )
    rates = [metrics["lr"] for metrics in run.epochs]
    expected = [
        float(np.asarray(schedule()(BATCHES * (epoch + 1)))) * FACTOR**epoch
        for epoch in range(EPOCHS)
    ]
    np.testing.assert_allclose(rates, expected, rtol=1e-5, err_msg=combo.name)
