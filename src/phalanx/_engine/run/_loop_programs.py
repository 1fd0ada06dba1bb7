"""The programs a fit's loop builds, each explicitly and before a batch of
it is placed (the first of all from a pass's first batch, one per new step
size), and what it tells the alarms of each train call that compiled."""

from collections.abc import Iterable
from typing import Any

import jax

from ...data import Resumable
from ..feed._device_batch import DeviceBatch
from ..feed._prepare import first_program
from ..program._program import Program
from ..program._signature import named_arguments
from ._events import FitEvents
from ._loop_inputs import LoopParts


def program_for(parts: LoopParts, events: FitEvents, first: DeviceBatch) -> Program:
    """The program for the global step size of `first` (a batch knows its
    process's): the one built, or one built now (a new signature, counted)."""
    programs = parts.programs
    size = first.size * jax.process_count()
    program = programs.get(size)
    if program is None or not program.compiled:
        base = programs.first
        assert base is not None, "the pass's first batch built a program"
        compiles = events.compile_count
        program = programs.resized(base, size)
        tell_compiled(events, parts, program.kind, compiles, program.arguments)
    return program


def build_first(parts: LoopParts, events: FitEvents, batch: Any, where: str) -> Program:
    """The first program of all, built for the pass's first `batch`."""
    compiles = events.compile_count
    program = first_program(parts.pipeline, parts.programs, batch, where)
    tell_compiled(events, parts, program.kind, compiles, program.arguments)
    return program


def build_from_peek(data: Iterable[Any], parts: LoopParts) -> None:
    """Build the first program from the data's first batch without training
    on it or moving the data on: reading an epoch's sums takes the program's
    readers, and a run resumed at its epoch's last step has no batch left
    to build it from."""
    state = data.state_dict() if isinstance(data, Resumable) else None
    try:
        first = next(iter(data), None)
    finally:
        if isinstance(data, Resumable):
            data.load_state_dict(state)
    if first is not None:
        first_program(parts.pipeline, parts.programs, first, "batch 0")


def tell_compiled(
    events: FitEvents, parts: LoopParts, kind: str, since: int, args: tuple[Any, ...]
) -> None:
    """A train call compiled (the compiles since `since`), for `args` (its
    arguments, or the abstract ones a program was built for): tell the
    alarms what they were."""
    treedef, names = parts.layout.treedef, parts.pipeline.batch_names
    spec, arguments = named_arguments(args, treedef, names)
    events.compiled(kind, since, spec, arguments)
