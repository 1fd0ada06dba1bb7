"""One candidate of a plan, built on abstract arguments: its state's layout
and bytes per device (known without compiling, the plan's memory bound),
its FLOPs (from a trace, the plan's time bound), then, compiled ahead of
time, its memory, its collectives' bytes and its predicted step time: the
compiled program's own work (`_cost.step_work`: its FLOPs, the bytes its
kernels move and its collectives, loop by loop, each kernel timed) priced
at the `DeviceSpec`'s rates, measured on the device where a plan
calibrated it. Nothing is placed or run: every argument is a
`jax.ShapeDtypeStruct`.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax

from .._engine.program._lint import held_bytes, layout_warnings, stacked_leaves
from .._engine.program._program import Program, ProgramParts
from .._engine.program._programs import Programs
from .._engine.program._spec import BatchSpec
from .._engine.program._summary import StepMemory
from .._engine.step._layout import StateLayout, leaf_names, state_layout
from .._engine.step._step import StepParts
from ..strategies import Strategy
from ..strategies._placement import HOST_MEMORY
from ._cost import step_work
from ._devices import DeviceSpec
from ._hlo import collective_bytes
from ._space import Candidate, Remat, with_remat


@dataclasses.dataclass(frozen=True)
class Bounds:
    """What a candidate costs at least, known before it is compiled.

    Attributes:
        state: the bytes of the training state (parameters, optimizer
            state, ...) in device memory on the device holding the most: no
            step takes less.
        host: the bytes of it kept in host memory (offloaded) per device.
        flops: the step's FLOPs per device (from its trace).
        seconds: no prediction of its step time is lower: the larger of its
            FLOPs at the device's peak and reading and writing its state at
            the memory's bandwidth, plus the offloaded state's trip to the
            device and back.
    """

    state: int
    host: int
    flops: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class Measured:
    """A compiled candidate's figures, per device.

    Attributes:
        memory: the compiled step's memory, as XLA reports it.
        peak: what the step holds at most in device memory: the memory's
            peak (its code in it on an accelerator; under the held guard,
            ``_held.py``, the spare state a fit holds beside the state, an
            argument of the step compiled), less the offloaded state where
            the backend counts host memory as the device's (XLA:CPU).
        collectives: the bytes it sends to other devices in one step.
        compute, traffic, communication, host: the cost model's seconds for
            its FLOPs, its memory traffic, its collectives (their bytes at
            the link's bandwidth, plus the link's latency once each) and its
            offloaded state's trips between host and device.
        kernels: its kernels' seconds, each at the pace of the slower of its
            FLOPs and its traffic (`_cost.step_work`).
        flops: the matrix FLOPs costed: the compiled program's, or the
            traced count where that is more.
        accessed: the bytes its kernels read and write, as costed.
        collective_ops: the collectives it runs in one step.
    """

    memory: StepMemory
    peak: int
    collectives: float
    compute: float
    traffic: float
    communication: float
    host: float = 0.0
    flops: float = 0.0
    accessed: float = 0.0
    collective_ops: int = 0
    kernels: float = 0.0

    @property
    def seconds(self) -> float:
        """The predicted step time: the kernels', each as fast as the slower
        of its compute and its memory traffic allows, one after another (or
        the step's FLOPs or bytes at the device's rates, where a floor
        makes those more); collectives and host transfers do not overlap
        them (a conservative model)."""
        pace = max(self.kernels, self.compute, self.traffic)
        return pace + self.communication + self.host


class Builder:
    """Builds a trainer's step under other strategies and remat settings,
    from its parts and the abstract state (never its arrays)."""

    def __init__(
        self,
        step: StepParts,
        layout: StateLayout,
        *,
        traced_checks: bool,
        spec: BatchSpec,
        size: int,
    ):
        self._step = step
        self._state = eqx.filter_eval_shape(layout.unflatten, layout.structs)
        self._checks = traced_checks
        self.spec = spec
        self.size = size

    @property
    def abstract_model(self) -> Any:
        """The trainer's model, as shapes."""
        return self._state.model

    def layout(self, strategy: Strategy, remat: Remat | None) -> StateLayout:
        """The state's layout under `strategy`, its stacks set to `remat`."""
        # Everywhere: the optimizer's moments hold the model's structure too.
        state = with_remat(self._state, remat)
        dynamic, static = eqx.partition(
            state, lambda x: isinstance(x, jax.ShapeDtypeStruct)
        )
        found: list[StateLayout] = []

        def trace(arrays: Any) -> int:
            found.append(state_layout(strategy, eqx.combine(arrays, static)))
            return 0

        jax.eval_shape(trace, dynamic)  # the strategy reads shapes alone
        return found[0]

    def program(self, strategy: Strategy, layout: StateLayout) -> tuple[Program, float]:
        """The step's program under `strategy` (traced, not compiled) and
        its FLOPs per device."""
        programs = Programs(
            ProgramParts(
                self._step._replace(strategy=strategy),
                layout,
                self._checks,
            )
        )
        program = programs.build(self.spec, self.size, compile=False)
        return program, programs.flops(program, self.size).per_device


def state_bytes(layout: StateLayout, *, host: bool = False) -> int:
    """The bytes of a state laid out as `layout` on its fullest device, in
    device memory (or, with `host`, those kept in host memory)."""
    kept = [
        (struct, sharding)
        for struct, sharding in zip(layout.structs, layout.shardings, strict=True)
        if (getattr(sharding, "memory_kind", None) == HOST_MEMORY) == host
    ]
    if not kept:
        return 0
    structs, shardings = zip(*kept, strict=True)
    return max(held_bytes(structs, shardings).values(), default=0)


def lint(layout: StateLayout, min_size: int) -> tuple[str, ...]:
    """The layout lint's lines for `layout` (as `summary()` says them)."""
    return tuple(
        layout_warnings(
            leaf_names(layout.treedef),
            layout.structs,
            layout.shardings,
            min_size,
            stacked_leaves(layout.treedef),
        )
    )


def bounds(layout: StateLayout, flops: float, device: DeviceSpec) -> Bounds:
    """A candidate's `Bounds`, from its layout and FLOPs per device."""
    state, host = state_bytes(layout), state_bytes(layout, host=True)
    seconds = max(flops / device.flops, 2 * state / device.memory_bandwidth)
    return Bounds(state, host, flops, seconds + 2 * host / device.host_bandwidth)


def measure(
    program: Program,
    candidate: Candidate,
    bound: Bounds,
    devices: Sequence[Any],
    device: DeviceSpec,
    *,
    compile: Callable[[jax.stages.Lowered, tuple[Any, ...]], Any] = (
        lambda lowered, _: lowered.compile()
    ),
) -> Measured:
    """Compile the call a fit of `program` makes first ahead of time (by
    `compile`, given its lowering and abstract arguments; it returns a
    compiled program, or what a plan kept of one: its text and memory
    analysis) and cost it at `device`'s rates.

    What it costs, per device: its matrix FLOPs (those of the compiled
    program, loops' trips counted, or the traced count where that is
    more, so that no prediction is under its `bound`), the bytes its
    kernels read and write (the compiled program's, or the state read and
    written once, whichever is more), each kernel's time at those rates,
    and each collective's bytes and one link latency (`Measured`)."""
    del candidate  # the compiled program's loops say its microbatches
    compiled = compile(program.lower_first(), program.first_arguments)
    stats = compiled.memory_analysis()
    memory = StepMemory.of_stats(stats, code=devices[0].platform != "cpu")
    if memory is None:  # every backend JAX 0.10 runs on reports it
        raise RuntimeError("the backend reports no memory analysis to plan with")
    text = compiled.as_text() or ""
    sent = collective_bytes(text, len(devices))
    work = step_work(text, len(devices), (device.flops, device.memory_bandwidth))
    flops = max(bound.flops, work.flops)
    accessed = max(work.bytes, 2.0 * bound.state)
    # Offloaded state in the arguments, its donated outputs aliased: +host
    # in the peak, where the backend does not count host memory apart.
    apart = int(getattr(stats, "host_argument_size_in_bytes", 0) or 0) > 0
    return Measured(
        memory=memory,
        peak=memory.peak - (0 if apart else bound.host),
        collectives=sent,
        compute=flops / device.flops,
        traffic=accessed / device.memory_bandwidth,
        communication=sent / device.link_bandwidth
        + work.collectives * device.link_latency,
        host=2 * bound.host / device.host_bandwidth,
        flops=flops,
        accessed=accessed,
        collective_ops=work.collectives,
        kernels=work.seconds,
    )
