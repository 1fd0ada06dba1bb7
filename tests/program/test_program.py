"""The compiled program as one value: built explicitly, before any batch of
its signature is placed, with the first call's train step compiled there
(not inside batch preparation, nor at the loop's first call); a new batch
size is a new program."""

import traceback

import equinox as eqx
import jax
import optax
import pytest

import phalanx as px
from helpers import make_data, make_model
from phalanx._engine.program._program import Program


COMPILE = "/jax/core/compile/backend_compile_duration"


@pytest.fixture
def compiles():
    """The Python stacks (function names) of each XLA compile from now on."""
    stacks: list[list[str]] = []

    def listener(event: str, duration_secs: float, **kwargs) -> None:
        del duration_secs, kwargs
        if event == COMPILE:
            stacks.append([frame.name for frame in traceback.extract_stack()])

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield stacks
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("steps_per_call", [1, 2])
def test_the_first_compile_is_the_program_build(compiles, steps_per_call):
    x, y = make_data(64)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(8),
        steps_per_call=steps_per_call,
        progress=False,
    )
    trainer.fit([(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)], epochs=2)
    in_loop = [stack for stack in compiles if "fit_loop" in stack]
    # The train step compiles once, in the program's explicit build: never
    # at a train call or while a batch is prepared (stacking batches on the
    # devices compiles a small program of its own).
    assert len([stack for stack in in_loop if "build_program" in stack]) == 1
    assert not [s for s in in_loop if "_run" in s or "prepare" in s]
    program = trainer._parts.programs.first
    assert isinstance(program, Program)
    assert program.size == 16 and program.spec.shapes == ((5,), ())
    assert (program.train_many is not None) == (steps_per_call > 1)
    assert program.kind == ("train step" if steps_per_call == 1 else "train step x2")
    assert program.memory is not None and program.memory.argument_size_in_bytes > 0


def test_a_new_step_size_is_a_new_program(compiles):
    x, y = make_data(64)
    trainer = px.DataParallelTrainer(
        make_model(), optax.sgd(0.1), strategy=px.ShardingStrategy(8), progress=False
    )
    trainer.fit([(x[:32], y[:32])], epochs=1)
    first = trainer._parts.programs.first
    trainer.fit([(x[:16], y[:16])], epochs=1)
    assert trainer._parts.programs.first is first  # the spec's: kept
    other = trainer._parts.programs.get(16)
    assert first is not None and other is not None and other is not first
    assert other.spec == first.spec
    builds = [stack for stack in compiles if "build_program" in stack]
    assert len(builds) == 2


def test_a_program_to_evaluate_with_is_compiled_by_fit_before_its_step(compiles):
    x, y = make_data(32)
    trainer = px.DataParallelTrainer(
        make_model(), optax.sgd(0.1), strategy=px.ShardingStrategy(8), progress=False
    )
    assert trainer._parts.programs.first is None
    trainer.evaluate([(x, y)])
    trainer.flops_per_step((x, y))
    first = trainer._parts.programs.first
    assert first is not None and not first.compiled and first.memory is None
    assert not [stack for stack in compiles if "build_program" in stack]
    trainer.fit([(x, y)], epochs=1)
    program = trainer._parts.programs.get(32)
    assert program is not None and program.compiled
    assert len([stack for stack in compiles if "build_program" in stack]) == 1


def test_summary_reads_the_fits_program():
    x, y = make_data(32)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=px.ShardingStrategy(8), progress=False
    )
    before = trainer.summary((x, y)).step  # compiled from the lowered step
    trainer.fit([(x, y)], epochs=1)
    program = trainer._parts.programs.get(32)
    assert program is not None and program.compiled
    after = trainer.summary((x, y)).step  # the fit's program's own
    assert before is not None and after is not None and after == before
    assert after.arguments == program.memory.argument_size_in_bytes


def test_a_trainer_keeps_no_copy_of_the_model_it_started_from():
    """Its programs keep the model's shapes alone (to explain a first batch
    that does not fit): once the caller lets the model go, the device holds
    the state's arrays and nothing else (the state's are copies, so a
    parameter's worth of memory a trainer held for nothing; on a v5e, 77 MB
    for the tests' 19 M transformer)."""
    import gc

    def live() -> int:
        gc.collect()
        return sum(array.nbytes for array in jax.live_arrays())

    before = live()  # other tests' arrays, in this worker
    model = make_model()
    trainer = px.DataParallelTrainer(
        model, optax.adam(1e-2), loss="mse", progress=False
    )
    del model
    held = sum(
        leaf.nbytes for leaf in jax.tree.leaves(trainer.state) if eqx.is_array(leaf)
    )
    assert live() - before == held
