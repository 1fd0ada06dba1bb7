"""A trainer's compiler: it builds the `Program` of a batch signature when
asked (`StepCompiler.build`, explicitly, before a batch of it is placed),
the predict steps per input structure, and the zeroed sums a program's calls
start from. Nothing here sees the trainer or a host batch: programs are made
from `ProgramParts`."""

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from .._checks._batch import BatchSpec, Leaf, input_names
from .._checks._hooks import HookError
from .._state._sums import NO_FLAGS, EpochSums
from .._state._train_state import TrainState
from .._telemetry._flops import FlopCounter, StepFlops
from .._typing import HostMetrics
from ..strategies._placement import put_replicated, replicated_copies, stacked
from ._forward import InferenceKeyError
from ._layout import StateLayout
from ._program import Program, ProgramParts, build_program
from ._step import StepParts, build_predict_step


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


class StepCompiler:
    """Builds a trainer's programs (`build`), its predict steps (per input
    structure, on first use) and the zeroed sums its calls start from."""

    def __init__(
        self,
        parts: StepParts,
        layout: StateLayout,
        *,
        model: eqx.Module,
        model_state: eqx.nn.State | None,
        traced_checks: bool,
        steps_per_call: int = 1,
    ):
        """Args:
        parts: what the steps are made of.
        layout: how the state travels (structure, static part, shardings).
        model, model_state: the model (and its state) the run started from,
            to explain a first batch that does not fit.
        traced_checks: check each batch's shapes inside the step too.
        steps_per_call: steps of `Program.train_many`, one compiled call.
        """
        self.parts = parts
        self.layout = layout
        self.program_parts = ProgramParts(
            parts, layout, model, model_state, traced_checks, steps_per_call
        )
        if steps_per_call > 1:  # checked before anything is built
            stacked(parts.strategy.batch_sharding)
        self._predict: dict[Any, tuple[jax.stages.Wrapped, list[Sharding]]] = {}
        self._mesh = parts.strategy.mesh
        self._flops = FlopCounter()

    def build(self, spec: BatchSpec, size: int, *, compile: bool = True) -> Program:
        """The `Program` for batches of `spec` at a global step of `size`
        examples (see `build_program`).

        Raises:
            TypeError, ValueError: the batch does not fit the model or loss.
        """
        return build_program(self.program_parts, spec, size, compile=compile)

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
            grads, program.step_sums.means(host), self.layout.unflatten(new)
        )

    def predict(
        self, treedef: Any, leaves: list[Leaf]
    ) -> tuple[jax.stages.Wrapped, list[Sharding]]:
        """The jitted predict step for inputs of this structure and shapes per
        example (validated once), and where each input leaf goes."""
        key = (treedef, tuple(leaf.shape[1:] for leaf in leaves))
        found = self._predict.get(key)
        if found is None:
            strategy = self.parts.strategy
            splits = strategy.batch_leaf_shardings(
                input_names(treedef), key[1], whole=False
            )
            fn = build_predict_step(self.parts, self.layout, treedef)
            shapes = [
                jax.ShapeDtypeStruct(
                    (strategy.num_devices, *leaf.shape[1:]), leaf.dtype
                )
                for leaf in leaves
            ]
            try:
                jax.eval_shape(fn, self.layout.structs, shapes)
            except (InferenceKeyError, HookError):
                raise  # not the rows' fault: the message says what to do
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"x: rows of shapes {[leaf.shape[1:] for leaf in leaves]} do "
                    "not fit the model; pass rows the model accepts. "
                    f"The error was: {error}"
                ) from error
            step = jax.jit(
                fn,
                in_shardings=(self.layout.shardings, splits),
                out_shardings=strategy.batch_sharding,
            )
            found = self._predict[key] = (step, splits)
        return found

    def epoch_sums(self, program: Program) -> EpochSums:
        """Zeroed on-device sums of an epoch, and the non-finite step record."""
        zeros = np.zeros(program.sums.size, np.float32)
        return EpochSums(*put_replicated((zeros, NO_FLAGS), self._mesh))

    def copy_replicated(self, arrays: list[jax.Array]) -> list[jax.Array]:
        """Copies of `arrays`, replicated on the strategy's devices."""
        return replicated_copies(arrays, self._mesh)

    def eval_sums(self, program: Program) -> jax.Array:
        """Zeroed on-device sums of an evaluation."""
        zeros = np.zeros(program.eval_sums.size, np.float32)
        return put_replicated(zeros, self._mesh)

    def flops(self, program: Program, size: int) -> StepFlops:
        """The train step's FLOPs at a global step of `size` examples
        (counted once per size)."""
        devices = self.parts.strategy.num_devices
        return self._flops.count(size, devices, lambda: _trace(program, size))


def _trace(program: Program, size: int) -> jex.Jaxpr:
    """The train step's jaxpr on abstract arguments of `size` examples:
    `jax.jit`'s `trace` (from JAX's cache where the program was lowered at
    that size), never compiled or run."""
    spec = program.spec
    state, sums, flags = program.arguments[:3]
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
