"""What a plan found (`Plan`): a row per candidate weighed, the choice, and
what to pass to `DataParallelTrainer` (or ``phalanx train``) to run it."""

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.table import Table

from .._engine.program._summary import format_bytes, plain_text
from .._telemetry._flops import format_flops
from ..strategies import Strategy
from ._choice import TIE, choose
from ._command import train_command
from ._devices import DeviceSpec
from ._space import Candidate, PlanSpace, remat_name, with_remat


if TYPE_CHECKING:
    from ._measure import Bounds, Measured


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One candidate as the plan left it.

    Attributes:
        candidate: its mesh split, microbatches and remat setting.
        status: ``"fits"`` (compiled; its peak within the budget less the
            margin), ``"too big"`` (compiled; it is not), ``"pruned"`` (not
            compiled: its state alone exceeds that, or twice it where a fit
            keeps a spare: the held guard), ``"bounded"`` (not
            compiled: its time bound is no faster than a candidate that
            fits, or the least peak of its kind does not fit),
            ``"failed"`` (XLA refused it), ``"skipped"`` (the batch does
            not split over it).
        why: the reason, in words (empty where it fits).
        bounds: what it costs at least, known before compiling (None where
            skipped).
        measured: its compiled figures (None where not compiled).
        least_peak: where the least peak of its kind bounded it out, the
            peak it holds at least (`_floor.SLACK` under that one's).
        timed: its median step time, run and timed (``measure=``; None
            where not).

    Its table row: the state's bytes on the fullest device (and those kept
    in host memory), the compiled step's argument, temporary and peak bytes
    per device, its FLOPs per device, the bytes a device sends in
    collectives, and the predicted step time.
        warnings: the layout lint's lines for its layout (as `summary()`
            says them: a large leaf left whole, an uneven split, ...).
    """

    candidate: Candidate
    status: str
    why: str = ""
    bounds: "Bounds | None" = None
    measured: "Measured | None" = None
    warnings: tuple[str, ...] = ()
    least_peak: int | None = None
    timed: float | None = None

    @property
    def seconds(self) -> float | None:
        """The step time it is ranked by: measured where it was timed,
        else predicted (None where not compiled)."""
        if self.timed is not None:
            return self.timed
        return None if self.measured is None else self.measured.seconds


@dataclasses.dataclass(frozen=True)
class Plan:
    """A fit's plan: the candidates weighed and the one chosen: the fastest
    that fits within the budget less the margin (predicted, or measured
    where it timed steps), the simpler layout where two are within
    `_choice.TIE` of each other (None where none fits).

    Attributes:
        rows: every candidate, in the order weighed.
        choice: the chosen row (None: nothing fits).
        budget: the bytes each device may hold.
        margin: the share of the budget kept free.
        device: the cost model's device.
        devices: how many devices the plan is for.
        size: the global batch's examples.
        compiled: how many candidates it compiled.
        seconds: how long the plan took.
        space: what it chose among.
        reused: how many candidates it found compiled (by an earlier plan
            in this process, or earlier in this one), not compiled again.
        timed_steps: the steps timed of each candidate run (0: none was;
            the choice is by prediction).
        from_cache: of those compiled, how many JAX read from its
            persistent compilation cache (``jax_compilation_cache_dir``)
            instead of compiling them.
    """

    rows: tuple[PlanRow, ...]
    choice: PlanRow | None
    budget: int
    margin: float
    device: DeviceSpec
    devices: int
    size: int
    compiled: int
    seconds: float
    space: PlanSpace
    reused: int = 0
    timed_steps: int = 0
    from_cache: int = 0

    @classmethod
    def of(cls, rows: Sequence[PlanRow], **fields: Any) -> "Plan":
        """The plan of `rows`: its choice the fastest that fits, by measured
        time among those timed where any was, else by prediction; within
        `TIE` of it, the simplest (`_choice.choose`)."""
        fitting = [r for r in rows if r.status == "fits" and r.measured is not None]
        timed = [r for r in fitting if r.timed is not None]
        choice = choose(
            timed or fitting,
            lambda r: r.seconds,  # pyright: ignore[reportArgumentType, reportReturnType]
            lambda r: r.candidate,
        )
        return cls(tuple(rows), choice, **fields)

    @property
    def by_measurement(self) -> bool:
        """Whether the choice was by measured step time."""
        return self.choice is not None and self.choice.timed is not None

    @property
    def smallest_peak(self) -> PlanRow | None:
        """The compiled row of the smallest peak (None: none compiled)."""
        compiled = [r for r in self.rows if r.measured is not None]
        return min(compiled, key=lambda r: r.measured.peak, default=None)  # pyright: ignore[reportOptionalMemberAccess]

    def nothing_fits(self) -> str:
        """Why nothing fits, in one line (with the smallest peak found)."""
        smallest = self.smallest_peak
        usable = (
            f"{format_bytes(self.budget)} a device less the {self.margin:.0%} margin"
        )
        if smallest is None or smallest.measured is None:
            least = min(
                (r for r in self.rows if r.bounds is not None),
                key=lambda r: r.bounds.state,  # pyright: ignore[reportOptionalMemberAccess]
                default=None,
            )
            if least is None or least.bounds is None:
                return "nothing fits: the batch splits over no candidate of the space"
            return (
                f"nothing fits: no candidate was compiled, the smallest state is "
                f"{format_bytes(least.bounds.state)} per device "
                f"({least.candidate.describe()}), over the budget of {usable}; "
                f"add devices or shrink the model{self._or_meshes()}"
            )
        return (
            f"nothing fits: the smallest peak found is "
            f"{format_bytes(smallest.measured.peak)} per device "
            f"({smallest.candidate.describe()}), over the budget of {usable}; "
            f"add devices, shrink the batch, or allow more microbatches"
            f"{self._or_meshes()}"
        )

    def _or_meshes(self) -> str:
        """Where a strategy was planned as it is: the mesh splits, which
        may split what it does not."""
        if self.space.strategy is None:
            return ""
        return (
            ", or weigh the mesh splits, which can split the state (px.plan "
            "without a strategy, or a MeshStrategy trainer)"
        )

    def _chosen(self) -> Candidate:
        if self.choice is None:
            raise ValueError(self.nothing_fits())
        return self.choice.candidate

    def strategy(self, devices: Sequence[Any] | None = None) -> Strategy:
        """The chosen candidate's strategy (on `devices`: by default the
        first `devices` of `jax.devices()`, or the space's strategy's own).

        Raises:
            ValueError: nothing fits, or `devices` are not those of the
                space's strategy.
        """
        import jax

        chosen = self._chosen()
        if devices is None:
            devices = self.space.own_devices or jax.devices()[: self.devices]
        return chosen.strategy(self.space, devices)

    def trainer_kwargs(self) -> dict[str, Any]:
        """What to pass to `DataParallelTrainer` (with the model that
        `model` returns): ``{"strategy": ...}``."""
        return {"strategy": self.strategy()}

    def model(self, model: Any) -> Any:
        """`model` with its `Stacked` stacks set to the chosen remat."""
        return with_remat(model, self._chosen().remat)

    def command(self, flags: Sequence[str] = ()) -> str:
        """The ``phalanx train`` command that runs the choice: `flags` (the
        options of the run planned), then the chosen layout's.

        Raises:
            ValueError: nothing fits, or the choice is one ``phalanx train``
                cannot say (`_command.train_command`).
        """
        return train_command(self.space, self._chosen(), flags)

    def __rich__(self) -> Table:
        kind = "relative" if self.device.relative else "predicted"
        relative = self.device.relative
        timed = any(row.timed is not None for row in self.rows)
        table = Table(
            title=f"plan: {self.size} examples a step on {self.devices} devices, "
            f"budget {format_bytes(self.budget)} a device (margin {self.margin:.0%})",
            caption=self._caption(),
        )
        columns = (
            "strategy"
            if self.space.strategy is not None
            else "mesh (data·fsdp·context·tensor)",
            "micro",
            "remat",
            "state",
        )
        for column in (*columns, "arguments", "temporaries", "peak", "FLOPs"):
            table.add_column(column, justify="right")
        table.add_column("collectives", justify="right")
        table.add_column(f"step ({kind})", justify="right")
        if timed:
            table.add_column("measured", justify="right")
        table.add_column("", justify="left")
        for row in self.rows:
            c, m, b = row.candidate, row.measured, row.bounds
            mark = "<- chosen" if row is self.choice else row.status
            if row.why and row is not self.choice:
                mark += f": {row.why}"
            # Not compiled: what it costs at least, as its bounds say.
            least = (
                None
                if b is None
                else (b.state if row.least_peak is None else row.least_peak)
            )
            cells = [
                c.sizes,
                str(c.microbatches),
                "-" if c.remat is None else remat_name(c.remat),
                "-" if b is None else _on_host(format_bytes(b.state), b.host),
                "-" if m is None else format_bytes(m.memory.arguments),
                "-" if m is None else format_bytes(m.memory.temporaries),
                _at_least(least, format_bytes) if m is None else format_bytes(m.peak),
                "-" if b is None else format_flops(b.flops),
                "-" if m is None else format_bytes(int(m.collectives)),
                (
                    _at_least(
                        None if b is None else b.seconds, lambda t: _time(t, relative)
                    )
                    if m is None
                    else _time(m.seconds, relative)
                ),
            ]
            if timed:
                cells.append("-" if row.timed is None else _time(row.timed, False))
            table.add_row(*cells, mark)
        return table

    def _caption(self) -> str:
        device = self.device
        memory, links = device.memory_bandwidth / 1e9, device.link_bandwidth / 1e9
        model = (
            f"cost model: {device.name}, {device.flops / 1e12:g} TFLOP/s, memory "
            f"{memory:g} GB/s, links {links:g} GB/s"
        )
        if device.link_latency > 0:
            model += f" after {device.link_latency * 1e6:.3g} us"
        if device.calibrated:
            model += " (measured on these devices)"
        if device.relative:
            model += " (nominal: times rank the candidates, they do not predict)"
        cached = f" ({self.from_cache} from JAX's cache)" if self.from_cache else ""
        done = (
            "peak: the compiled step's as XLA plans it (memory_analysis: its "
            "arguments, outputs not donated, temporaries; its code on an "
            "accelerator; the spare state, where a fit holds one)\n"
            f"compiled {self.compiled}{cached}, reused {self.reused}, in "
            f"{self.seconds:.1f} s"
        )
        if self.choice is not None and self.choice.warnings:
            said = self.choice.warnings
            done += "".join(f"\nlayout: {line}" for line in said[:3])
            if len(said) > 3:
                done += f"\nlayout: and {len(said) - 3} more (plan.choice.warnings)"
        if self.choice is None:
            return f"{self.nothing_fits()}\n{model}\n{done}"
        timed = sum(r.timed is not None for r in self.rows)
        by = (
            f"measured step time (the median of {self.timed_steps} steps of each "
            f"of the {timed} fastest predicted)"
            if self.by_measurement
            else "predicted step time"
        )
        chosen = (
            f"chosen: {self.choice.candidate.describe()}, by {by}; a tie within "
            f"{TIE:.0%} goes to the simpler layout"
        )
        return f"{chosen}\n{model}\n{done}"

    def __str__(self) -> str:
        """The table as plain text (no colours), as wide as it needs."""
        return plain_text(self.__rich__())


def _on_host(state: str, host: int) -> str:
    """A state's device bytes, and its host bytes where it has some."""
    return f"{state} (+{format_bytes(host)} host)" if host else state


def _at_least(value: int | float | None, show: Any) -> str:
    """A bound's cell: ``≥ value`` (``-`` where there is none)."""
    return "-" if value is None else f"≥ {show(value)}"


def _time(seconds: float, relative: bool) -> str:
    if relative:
        return f"{seconds * 1e3:.3g} units"
    return f"{seconds * 1e3:.3g} ms"
