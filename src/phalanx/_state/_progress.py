"""Where a run is, as a value: its counters, its plan, the epoch's sums."""

import dataclasses
from collections.abc import Iterable, Mapping, Sized
from typing import Any

import jax

from .._validate import int_at_least, is_int, optional_int_at_least
from ._sums import EpochSums


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A fit's plan: where it started and how far it goes (checkpointed, so a
    resumed fit keeps the original start).

    Attributes:
        start_step: the step the run began at.
        start_epoch: the epoch the run began at.
        epochs: passes over the data from `start_epoch`, if given.
        steps: updates from `start_step`, if given.
    """

    start_step: int = 0
    start_epoch: int = 0
    epochs: int | None = None
    steps: int | None = None

    def done(self, step: int, epoch: int | None) -> bool:
        """Whether the plan is complete at `step` (and, if given, `epoch`)."""
        if self.steps is not None and step >= self.start_step + self.steps:
            return True
        return (
            epoch is not None
            and self.epochs is not None
            and epoch >= self.start_epoch + self.epochs
        )


@dataclasses.dataclass(frozen=True)
class RunProgress:
    """Where a run is. The loop takes one and returns the next; the trainer
    holds the latest, and checkpoints store it (`state_dict`).

    Attributes:
        step: optimizer updates made so far.
        epoch: the current epoch, from 0.
        epoch_steps: the steps made in the current epoch.
        plan: the fit's `RunPlan`.
        sums: the current epoch's running sums on the devices (None before
            its first step).
        sum_names: the names of `sums`' entries, in order (a statistic's
            entry takes several numbers of the vector).
        preempted: the signal that asked the run to stop, if one came.
        pass_rows: the rows of each step of the epoch's pass, all processes'
            (its first batch's, padded; None before it): a run resumed
            mid-epoch, on any number of processes, pads its batches to them
            as the pass did, so that it sums them in the same order.
    """

    step: int = 0
    epoch: int = 0
    epoch_steps: int = 0
    plan: RunPlan = RunPlan()
    sums: EpochSums | None = None
    sum_names: tuple[str, ...] = ()
    preempted: int | None = None
    pass_rows: int | None = None

    def stepped(self, sums: EpochSums, steps: int = 1) -> "RunProgress":
        """The progress after `steps` more steps, whose epoch's sums are `sums`.

        Made once a step: a copy of this one's fields with three replaced
        (0.4 µs), not through the frozen class's `__init__`, which sets
        each field with `object.__setattr__` (1.0 µs).
        """
        new = object.__new__(RunProgress)
        fields = new.__dict__
        fields.update(self.__dict__)
        fields["step"] = self.step + steps
        fields["epoch_steps"] = self.epoch_steps + steps
        fields["sums"] = sums
        return new

    def with_pass_rows(self, local: int) -> "RunProgress":
        """The progress once a pass's first batch is padded to `local` rows
        on each process (`pass_rows` counts every process's)."""
        return dataclasses.replace(self, pass_rows=local * jax.process_count())

    def local_pass_rows(self) -> int | None:
        """This process's share of `pass_rows` (a resume may be on another
        number of processes); None before the pass's first batch."""
        rows = self.pass_rows
        return None if rows is None else rows // jax.process_count()

    def next_epoch(self) -> "RunProgress":
        """The progress at the start of the next epoch."""
        return dataclasses.replace(
            self, epoch=self.epoch + 1, epoch_steps=0, sums=None, pass_rows=None
        )

    def done(self) -> bool:
        """Whether the plan is complete (by steps or by epochs)."""
        return self.plan.done(self.step, self.epoch)

    def steps_left(self) -> int | None:
        """The steps the plan has left to make, if it limits them."""
        plan = self.plan
        if plan.steps is None:
            return None
        return max(0, plan.start_step + plan.steps - self.step)

    def state_dict(self) -> dict[str, Any]:
        """Everything but the on-device sums, as plain data (for checkpoints;
        the sums' names and dtype are noted, their values saved as arrays)."""
        sums = self.sums
        return {
            "step": self.step,
            "epoch": self.epoch,
            "epoch_steps": self.epoch_steps,
            "run": dataclasses.asdict(self.plan),
            "pass_rows": self.pass_rows,
            "acc": None
            if sums is None
            else {
                "names": list(self.sum_names),
                "size": int(sums.sums.shape[0]),
                "dtype": str(sums.sums.dtype),
            },
        }

    @classmethod
    def from_state_dict(
        cls, state: dict[str, Any], sums: EpochSums | None
    ) -> "RunProgress":
        """The progress `state_dict` described, with the epoch's `sums` read
        back from the same checkpoint.

        Raises:
            ValueError: an entry is missing, or of a type or range no
                `state_dict` writes (a record edited or damaged), named in
                one line.
        """
        for name in ("step", "epoch", "epoch_steps", "run", "acc"):
            if name not in state:
                raise ValueError(f"{name!r} is missing")
        acc = _checked_acc(state["acc"])
        return cls(
            step=int_at_least("step", state["step"], 0),
            epoch=int_at_least("epoch", state["epoch"], 0),
            epoch_steps=int_at_least("epoch_steps", state["epoch_steps"], 0),
            plan=_checked_plan(state["run"]),
            sums=sums if acc else None,
            sum_names=tuple(acc["names"]) if acc else (),
            # (Absent from checkpoints written before it was kept.)
            pass_rows=optional_int_at_least("pass_rows", state.get("pass_rows"), 1),
        )


def _checked_plan(run: Any) -> RunPlan:
    """The `RunPlan` a state's ``"run"`` entry describes, checked."""
    fields = [field.name for field in dataclasses.fields(RunPlan)]
    if not isinstance(run, Mapping) or not set(run) <= set(fields):
        raise ValueError(f"run={run!r} must be a dict of {fields}")
    return RunPlan(
        start_step=int_at_least("run['start_step']", run.get("start_step", 0), 0),
        start_epoch=int_at_least("run['start_epoch']", run.get("start_epoch", 0), 0),
        epochs=optional_int_at_least("run['epochs']", run.get("epochs"), 0),
        steps=optional_int_at_least("run['steps']", run.get("steps"), 0),
    )


def _checked_acc(acc: Any) -> Mapping[str, Any] | None:
    """A state's ``"acc"`` entry (what the epoch's sums are), checked."""
    if acc is None:
        return None
    fields = acc if isinstance(acc, Mapping) else {}
    names, size = fields.get("names"), fields.get("size", 0)
    if not (
        isinstance(names, list)
        and all(isinstance(name, str) for name in names)
        and isinstance(fields.get("dtype"), str)
        and is_int(size)
        and size >= 0
    ):
        raise ValueError(
            f"acc={acc!r} must be None or a dict of the sums' 'names' (strs), "
            "'size' and 'dtype'"
        )
    return fields


def fit_totals(
    data: Iterable[Any], progress: RunProgress
) -> tuple[int | None, int | None]:
    """A run's epochs, and its steps from its start, where known up front."""
    run: RunPlan = progress.plan
    per_epoch = len(data) if isinstance(data, Sized) else None
    total = None
    if run.epochs is not None and per_epoch is not None:
        total = run.start_step + run.epochs * per_epoch
    if run.steps is not None:
        end = run.start_step + run.steps
        total = end if total is None else min(total, end)
    step = progress.step
    return run.epochs, None if total is None else max(total, step) - run.start_step


def resumed_sums_message(progress: RunProgress, names: tuple[str, ...]) -> str:
    """Why a run cannot go on summing the epoch it was resumed in."""
    return (
        f"resume: the checkpoint was saved in the middle of epoch {progress.epoch} "
        f"with running sums of {list(progress.sum_names)}, but this trainer's "
        f"steps sum {list(names)}; resume with the loss and metrics the run "
        "was saved with (or from a checkpoint saved at an epoch's end)"
    )
