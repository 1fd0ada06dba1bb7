"""The range test behind ``phalanx find-lr``, once every argument is valid:
the model, data and strategy ``phalanx train`` builds from the same options,
its optimizer (whose rate `find_lr` scales to each rate it tries), one
sweep, and what it found: a short table, the ``phalanx train`` command
that uses the rate, and ``lr_find.json`` and ``lr_find.png`` in the run
folder. Nothing is trained and no checkpoint written: the steps are
computed, not kept."""

import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from .._checks._device_note import devices_said
from .._engine.run._lr_finder import DIVERGED, SKIP_BEGIN, SKIP_END, LRFinderResult
from .._trainer import DataParallelTrainer
from ._args import FindLRArgs
from ._datasets import Split
from ._folder import FIND_LR_FILES, RunFolder
from ._train import (
    banner,
    make_loader,
    make_model,
    make_optimizer,
    make_strategy,
    start_notes,
)


RESULTS, PLOT = FIND_LR_FILES
# The fewest steps a suggestion needs: two slopes besides those it skips.
SUGGESTS_FROM = SKIP_BEGIN + SKIP_END + 2


def find_lr_and_report(
    args: FindLRArgs,
    devices: list[Any],
    train: Split,
    test: Split,
    *,
    defaulted: bool,
    plot: bool,
    note: str | None,
    folder: RunFolder,
) -> int:
    """Run the range test and report it; every argument has been checked.
    Writes into `folder` only once the model has been built and checked;
    the caller undoes a failed start there."""
    run = args.run
    x, y = train
    model, name = make_model(run, x, y)
    strategy = make_strategy(run, devices)
    trainer = DataParallelTrainer(
        model,
        make_optimizer(run, args.start),
        strategy=strategy,
        seed=run.seed,
        precision=run.precision,
        progress=False,
    )
    folder.create(main=True)
    for line in start_notes(defaulted, note):
        print(line, file=sys.stderr)
    steps = f"rates {args.start:.2g} to {args.end:.2g} in {args.steps} steps"
    print(banner(run, name, train, test, strategy, devices, steps))
    print(f"phalanx: {trainer.summary().short()}")
    devices_said()  # the banner above names them: no API note on top
    began = time.perf_counter()
    found = trainer.find_lr(
        make_loader(run, x, y),
        start=args.start,
        end=args.end,
        steps=args.steps,
    )
    seconds = time.perf_counter() - began
    command = _train_command(args, found.suggestion)
    _write_results(run.run_dir / RESULTS, args, found, command)
    written = [RESULTS]
    if plot:
        found.plot(run.run_dir / PLOT)
        written.append(PLOT)
    for label, value in _table(args, found, command):
        print(f"{label:<16} {value}")
    files = ", ".join(str(run.run_dir / name) for name in written)
    print(f"{'files':<16} {files} (the sweep took {seconds:.1f} s)")
    return 0


def diverged(found: LRFinderResult) -> bool:
    """Whether the sweep stopped because the loss diverged at its last rate:
    the smoothed loss not finite, or above `DIVERGED` times its best before."""
    last, before = found.smoothed[-1], found.smoothed[:-1]
    return not math.isfinite(last) or bool(before and last > DIVERGED * min(before))


def _train_command(args: FindLRArgs, suggestion: float | None) -> str | None:
    """``phalanx train`` with the options given that it takes, at the
    suggested rate (two significant digits); None without a suggestion."""
    if suggestion is None:
        return None
    return shlex.join(
        ["phalanx", "train", *args.train_flags, "--lr", _rate(suggestion)]
    )


def _table(
    args: FindLRArgs, found: LRFinderResult, command: str | None
) -> list[tuple[str, str]]:
    """What the sweep found, a row per label."""
    lrs, taken = found.lrs, len(found.lrs)
    if diverged(found):
        where = f"at lr {_rate(lrs[-1])} (step {taken}), where the sweep stopped"
    else:
        where = f"no, up to lr {_rate(lrs[-1])} (a higher --end goes further)"
    rows = [
        ("lr range tried", f"{_rate(lrs[0])} to {_rate(lrs[-1])}"),
        ("steps run", f"{taken} of {args.steps}"),
        ("loss diverged", where),
    ]
    if found.suggestion is None or command is None:
        rows.append(
            (
                "suggested lr",
                f"none: {taken} steps ran, a suggestion needs at least "
                f"{SUGGESTS_FROM}; pass more --steps, or a lower --start",
            )
        )
        return rows
    return [
        *rows,
        (
            "suggested lr",
            f"{_rate(found.suggestion)} (where the smoothed loss falls fastest)",
        ),
        ("train with it", command),
    ]


def _write_results(
    path: Path, args: FindLRArgs, found: LRFinderResult, command: str | None
) -> None:
    """lr_find.json: the range asked for, each step's rate, loss and
    smoothed loss (null where not finite: strict JSON), the suggestion, and
    the command that trains with it."""

    def finite(values: tuple[float, ...]) -> list[float | None]:
        return [v if math.isfinite(v) else None for v in values]

    results = {
        "start": args.start,
        "end": args.end,
        "steps": args.steps,
        "lrs": list(found.lrs),
        "losses": finite(found.losses),
        "smoothed": finite(found.smoothed),
        "diverged": diverged(found),
        "suggestion": found.suggestion,
        "train": command,
    }
    path.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")


def _rate(lr: float) -> str:
    """A learning rate to two significant digits: 0.021, 3.2e-05."""
    return f"{lr:.2g}"
