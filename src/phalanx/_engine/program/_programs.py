"""A trainer's programs: built here (`Programs.build`, explicitly, before a
batch of the signature is placed), kept by step size, and what their calls
start from (the zeroed sums), besides the predict steps per input structure
and the train step's FLOPs per size. Nothing here sees the trainer or a
host batch: programs are made from `ProgramParts`."""

from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from ..._checks._hooks import HookError
from ..._state._sums import NO_FLAGS, EpochSums
from ..._state._train_state import TrainState
from ..._telemetry._flops import StepFlops, count_flops
from ..._typing import HostMetrics
from ...strategies._placement import put_replicated, stacked
from ..step._forward import InferenceKeyError
from ..step._step import build_predict_step
from ._program import Program, ProgramParts, build_program
from ._spec import BatchSpec, Leaf, input_names


class StepValues(NamedTuple):
    """What one training step computes from a state.

    Attributes:
        grads: the reduced, averaged gradient the optimizer got (after the
            trainer's `gradients` hook), shaped like the model's
            floating-point arrays (None elsewhere).
        metrics: the step's ``{"loss": ..., **metrics}`` over its batch, as
            floats (with ``"skipped"`` and ``"loss_scale"`` where the step
            reports them).
        state: the `TrainState` the step leads to (its model state too).
    """

    grads: Any
    metrics: HostMetrics
    state: TrainState


class Programs:
    """The programs built so far for a trainer's batches (all of one spec,
    the first batch's), by step size: what the loop, `evaluate` and
    `summary` run, each built explicitly by whoever first needs one.

    Attributes:
        parts: what every program is built from.
        first: the first program built (None before any).
        steps_per_call: the steps of one call of a program's `train_many`.
    """

    def __init__(self, parts: ProgramParts):
        if parts.steps_per_call > 1:  # checked before anything is built
            stacked(parts.strategy.batch_sharding)
        self.parts = parts
        self.steps_per_call = parts.steps_per_call
        self.first: Program | None = None
        self._by_size: dict[int, Program] = {}
        self._predict: dict[Any, tuple[jax.stages.Wrapped, list[Sharding]]] = {}
        self._flops: dict[int, StepFlops] = {}
        self._mesh = parts.strategy.mesh

    def build(self, spec: BatchSpec, size: int, *, compile: bool = True) -> Program:
        """The `Program` for batches of `spec` at a global step of `size`
        examples (see `build_program`), kept.

        Raises:
            TypeError, ValueError: the batch does not fit the model or loss.
        """
        return self.add(build_program(self.parts, spec, size, compile=compile))

    def resized(self, program: Program, size: int) -> Program:
        """The program of `program`'s spec at a global step of `size`, kept."""
        return self.build(program.spec, size)

    def add(self, program: Program) -> Program:
        """Keep `program` (the first, or that of another step size)."""
        if self.first is None:
            self.first = program
        self._by_size[program.size] = program
        return program

    def get(self, size: int) -> Program | None:
        """The program built for a global step of `size` examples, if any."""
        return self._by_size.get(size)

    def epoch_sums(self, program: Program) -> EpochSums:
        """Zeroed on-device sums of an epoch, and the non-finite step record."""
        zeros = np.zeros(program.sums.size, np.float32)
        return EpochSums(*put_replicated((zeros, NO_FLAGS), self._mesh))

    def eval_sums(self, program: Program) -> jax.Array:
        """Zeroed on-device sums of an evaluation."""
        zeros = np.zeros(program.eval_sums.size, np.float32)
        return put_replicated(zeros, self._mesh)

    def values(
        self,
        program: Program,
        leaves: list[jax.Array],
        batch: list[Any],
        weight: Any,
        total: Any,
    ) -> StepValues:
        """What the train step computes from the state `leaves` on a placed
        batch (see `StepValues`); `leaves` stay valid."""
        epoch_sums = self.epoch_sums(program)
        new, grads, sums = program.inspect(leaves, *epoch_sums, batch, weight, total)
        host = np.asarray(jax.device_get(sums))
        return StepValues(
            grads, program.step_sums.means(host), self.parts.layout.unflatten(new)
        )

    def flops(self, program: Program, size: int) -> StepFlops:
        """The train step's FLOPs at a global step of `size` examples
        (counted once per size, from a trace: never compiled or run)."""
        known = self._flops.get(size)
        if known is None:
            devices = self.parts.step.strategy.num_devices
            total = count_flops(_trace(program, size))
            known = StepFlops(total=total, devices=devices, size=size)
            self._flops[size] = known
        return known

    def predict(
        self, treedef: Any, leaves: list[Leaf]
    ) -> tuple[jax.stages.Wrapped, list[Sharding]]:
        """The jitted predict step for inputs of this structure and shapes per
        example (validated once), and where each input leaf goes."""
        key = (treedef, tuple(leaf.shape[1:] for leaf in leaves))
        found = self._predict.get(key)
        if found is None:
            found = self._predict[key] = _predict_step(self.parts, treedef, leaves)
        return found


def _predict_step(
    parts: ProgramParts, treedef: Any, leaves: list[Leaf]
) -> tuple[jax.stages.Wrapped, list[Sharding]]:
    """A new predict step for inputs like `leaves` (see `Programs.predict`)."""
    step, layout = parts.step, parts.layout
    strategy = step.strategy
    per_example = tuple(leaf.shape[1:] for leaf in leaves)
    splits = strategy.batch_leaf_shardings(
        input_names(treedef), per_example, whole=False
    )
    fn = build_predict_step(step, layout, treedef)
    shapes = [
        jax.ShapeDtypeStruct((strategy.num_devices, *leaf.shape[1:]), leaf.dtype)
        for leaf in leaves
    ]
    try:
        jax.eval_shape(fn, layout.structs, shapes)
    except (InferenceKeyError, HookError):
        raise  # not the rows' fault: the message says what to do
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"x: rows of shapes {[leaf.shape[1:] for leaf in leaves]} do "
            "not fit the model; pass rows the model accepts. "
            f"The error was: {error}"
        ) from error
    jitted = jax.jit(
        fn,
        in_shardings=(layout.shardings, splits),
        out_shardings=strategy.batch_sharding,
    )
    return jitted, splits


def _trace(program: Program, size: int) -> jex.Jaxpr:
    """The train step's jaxpr on abstract arguments of `size` examples:
    `jax.jit`'s `trace` (from JAX's cache where the program was lowered at
    that size), never compiled or run."""
    spec = program.spec
    state, sums = program.arguments[:2]
    # A NumPy batch's leaves (unsharded): the count is the same for device
    # leaves.
    batch = [
        jax.ShapeDtypeStruct((size, *shape), dtype)
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    ]
    traced = program.traced.trace(
        state,
        jax.ShapeDtypeStruct(sums.shape, jnp.float32),
        jax.ShapeDtypeStruct(NO_FLAGS.shape, NO_FLAGS.dtype),
        batch,
        jax.ShapeDtypeStruct((size,), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    return traced.jaxpr.jaxpr
