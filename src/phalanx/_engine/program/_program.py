"""The compiled program of a fit as one value (`Program`), built explicitly
from a batch's spec and step size (`build_program`) before any batch of that
signature is placed or run.

The train step a fit calls first is compiled here, ahead of time, on
abstract arguments (`jax.jit(...).lower(...).compile()`, its layouts proven
on the way: `_ahead_of_time.py`): the loop then calls the compiled
executable, whose C++ dispatch costs what a `jax.jit` call's fast path does,
and a batch of another step size gets a `Program` of its own (built, and
counted by the recompile alarm, as a new one). Nothing here sees the
trainer, a host batch or a clock.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from ..._checks._hooks import HookError
from ..._state._sums import EpochSums, SumLayout
from ...strategies import Strategy
from ...strategies._placement import replicated, stacked
from ..step._held import holds, spare_for
from ..step._layout import StateLayout
from ..step._step import StepParts, build_steps, several_steps
from ..step._step_parts import TrainInputs
from ._ahead_of_time import call_arguments, compile_proven
from ._hints import first_batch_hint
from ._program_sums import eval_layout, step_layout, sum_layout
from ._spec import BatchSpec


class ProgramParts(NamedTuple):
    """What every `Program` of a trainer is built from.

    Attributes:
        step: the step's parts (hooks, optimizer, strategy, precision).
        layout: how the state travels (structure, shardings, shapes; the
            model's shapes alone explain a first batch that does not fit:
            no copy of the model's arrays is kept beside the state's).
        traced_checks: check each batch's shapes inside the step too.
        steps_per_call: the steps of one compiled `Program.train_many` call.
    """

    step: StepParts
    layout: StateLayout
    traced_checks: bool
    steps_per_call: int = 1

    @property
    def strategy(self) -> Strategy:
        """The strategy the programs are laid out by."""
        return self.step.strategy


class Program(NamedTuple):
    """The compiled functions of one batch signature (a `BatchSpec` at a
    global step of `size` examples) and what is known of them.

    Attributes:
        spec: what each batch looks like (per example).
        size: the global step size the train step is compiled for.
        train: one update, ``train(leaves, sums, flags, batch, weight,
            total) -> (leaves, sums, flags, step_sums)``; donates the state
            and the epoch's sums (not its flags: the loop waits on an
            earlier step's flags while later steps run). Compiled ahead of
            time where it is the call a fit makes first
            (``steps_per_call=1``), else a `jax.jit`. Under the held guard
            (`held`) it takes the run's spare after the state, ``train(leaves,
            spare, sums, flags, ...)``, and donates the spare instead.
        train_many: `steps_per_call` updates in one call on batches stacked
            along a leading steps axis, compiled ahead of time (None with
            ``steps_per_call=1``).
        traced: the train step's `jax.jit`, for tracing (FLOPs), lowering
            (`lower`, `summary`) and calls whose arguments the compiled
            step was not built for (a state leaf of another type).
        evaluate: ``evaluate(leaves, sums, batch, weight) -> sums``, the
            model in inference mode; donates the sums (a `jax.jit`: eval
            batches come in any size).
        inspect: the train step with its gradient as an output, keeping its
            state.
        sums: the entries of the packed sums: ``"loss"``, ``"weight"``,
            then the metrics.
        step_sums: the entries of a train call's step sums: the sums',
            then ``"skipped"`` and ``"loss_scale"`` where the step reports
            them.
        eval_sums: the same of the eval step's sums.
        outputs: the model's outputs for a batch of the spec, as shapes.
        arguments: the abstract arguments the first call's step was
            compiled for (``train``'s, or ``train_many``'s).
        memory: the compiled first call's memory analysis (its argument,
            output and temporary bytes per device), where the backend
            gives one (None where not compiled).
        compiled: whether the first call's train step is compiled (ahead
            of time); a program built to trace or inspect with is not, and
            `fit` builds its own before its first step.
        spare: under the held guard (``_held.py``: `train` is its step),
            the run's first spare: copies of the state's leaves in its
            layout, in one call (None: not held).
    """

    spec: BatchSpec
    size: int
    train: Callable[..., Any]
    train_many: Callable[..., Any] | None
    traced: jax.stages.Wrapped
    evaluate: jax.stages.Wrapped
    inspect: jax.stages.Wrapped
    sums: SumLayout
    step_sums: SumLayout
    eval_sums: SumLayout
    outputs: Any
    arguments: tuple[Any, ...]
    memory: Any
    compiled: bool = True
    spare: Callable[[list[jax.Array]], list[jax.Array]] | None = None

    @property
    def held(self) -> bool:
        """Whether `train` is the held guard's step."""
        return self.spare is not None

    def lower_first(self) -> jax.stages.Lowered:
        """The call a fit makes first, lowered for its abstract arguments
        (the spare's too, held) but not compiled: what `fit` compiles, so
        that a plan compiling it compiles the fit's own program (which the
        fit then takes: ``_executables.py``). Only a program built
        uncompiled (``compile=False``) has it to lower."""
        if self.compiled:
            raise ValueError("lower_first: the program is already compiled")
        call = self.train if self.train_many is None else self.train_many
        return call.lower(*self.first_arguments)  # pyright: ignore[reportFunctionMemberAccess]

    @property
    def first_arguments(self) -> tuple[Any, ...]:
        """The abstract arguments of the call a fit makes first: `arguments`,
        with the spare after the state under the held guard."""
        return first_arguments(self.arguments, held=self.held)

    @property
    def kind(self) -> str:
        """What the program's first call runs, as compiles are named."""
        many = self.train_many is not None
        return f"train step x{self.arguments[3][0].shape[0]}" if many else "train step"


def build_program(
    parts: ProgramParts, spec: BatchSpec, size: int, *, compile: bool = True
) -> Program:
    """The program for batches of `spec` at a global step of `size` examples:
    the model and loss traced abstractly on such a batch first (so one that
    does not fit fails with a clear message before anything compiles), then
    the first call's train step compiled (not with ``compile=False``: a
    program to trace, evaluate or inspect with, its jits compiling on first
    use; `fit` builds a compiled one before its first step).

    Raises:
        TypeError, ValueError: the batch does not fit the model or loss.
        LayoutError: (compiled, with traced checks) the step would reshard
            a parameter, a gradient or a state leaf (`_proofs.py`).
    """
    step, layout = parts.step, parts.layout
    train, evaluate, probe, inspect, held = build_steps(
        step,
        layout,
        spec.treedef,
        spec.traced_check() if parts.traced_checks else None,
    )
    shapes = [
        jax.ShapeDtypeStruct((size, *shape), dtype)
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    ]
    weight = jax.ShapeDtypeStruct((size,), jnp.float32)
    try:
        outputs, sums = jax.eval_shape(probe, layout.structs, shapes, weight)
    except HookError:
        raise  # not the batch's fault: its own message names the hook
    except (TypeError, ValueError, IndexError) as error:
        kind = TypeError if isinstance(error, TypeError) else ValueError
        started = eqx.filter_eval_shape(layout.unflatten, layout.structs)
        fix = first_batch_hint(
            spec, started.model, started.model_state, pass_key=step.pass_key, size=size
        )
        # The model's own error first: the hint is a guess at its cause.
        raise kind(
            f"data: the first batch {spec.describe()} does not fit the model and "
            f"loss: {error}\nHint: {fix}."
        ) from error
    state, split = layout.shardings, step.strategy.batch_sharding
    leaves = spec.shardings(step.strategy)  # each leaf's; `split`: the weights'
    rep = replicated(step.strategy.mesh)
    jitted = jax.jit(
        _sums_apart(train),
        donate_argnums=(0, 1),
        in_shardings=(state, rep, rep, leaves, split, rep),
        out_shardings=(state, rep, rep),
    )
    layout_of_sums = sum_layout(sums)
    packed = layout_of_sums.size
    arguments = call_arguments(layout, shapes, size, packed, (leaves, split, rep), 1)
    k = parts.steps_per_call
    call = jitted  # what the fit calls first: one step, or k of them
    hold = holds(step, layout, k)
    if hold:  # the spare after the state, donated in its place
        call = jax.jit(
            _sums_apart(held, spare=True),
            donate_argnums=(1, 2),
            in_shardings=(state, state, rep, rep, leaves, split, rep),
            out_shardings=(state, rep, rep),
        )
    if k > 1:
        stack = stacked(split)
        stacks = [stacked(leaf) for leaf in leaves]
        call = jax.jit(
            _sums_apart(several_steps(train)),
            donate_argnums=(0, 1),
            in_shardings=(state, rep, rep, stacks, stack, rep),
            out_shardings=(state, rep, rep),
        )
        arguments = call_arguments(
            layout, shapes, size, packed, (stacks, stack, rep), k
        )
    compiling = first_arguments(arguments, held=hold)
    compiled = (
        compile_proven(
            call, compiling, step, layout, spec.treedef, proofs=parts.traced_checks
        )
        if compile
        else None
    )
    if k > 1:
        first, train_many = jitted, compiled or call
    else:
        first, train_many = compiled or call, None
    return Program(
        spec=spec,
        size=size,
        train=first,
        train_many=train_many,
        traced=jitted,
        evaluate=jax.jit(
            evaluate,
            donate_argnums=(1,),
            in_shardings=(state, rep, leaves, split),
            out_shardings=rep,
        ),
        inspect=jax.jit(
            _sums_apart(inspect),
            in_shardings=(state, rep, rep, leaves, split, rep),
            out_shardings=(state, None, rep),
        ),
        sums=layout_of_sums,
        step_sums=step_layout(step, layout_of_sums),
        eval_sums=eval_layout(step, probe, (layout.structs, shapes, weight), sums),
        outputs=outputs,
        arguments=arguments,
        memory=None if compiled is None else compiled.memory_analysis(),
        compiled=compiled is not None,
        spare=spare_for(state) if hold else None,
    )


def first_arguments(arguments: tuple[Any, ...], *, held: bool) -> tuple[Any, ...]:
    """The arguments of a train call (`arguments`, the state's first) as
    the held guard's step takes them where `held`: the spare, laid out as
    the state, after the state."""
    return (arguments[0], *arguments) if held else arguments


def _sums_apart(train: Any, spare: bool = False) -> Any:
    """`train` (of one `TrainInputs`) taking its inputs as flat arguments,
    the epoch's sums and flags as two (so that a jit can donate the sums
    alone); with `spare`, the run's spare after the state, which `train`
    takes after its inputs."""

    def call(leaves: list[jax.Array], *rest: Any) -> Any:
        spares = rest[:1] if spare else ()
        sums, flags, batch_leaves, weight, total = rest[len(spares) :]
        epoch_sums = EpochSums(sums, flags)
        inputs = TrainInputs(leaves, epoch_sums, batch_leaves, weight, total)
        return train(inputs, *spares)

    return call
