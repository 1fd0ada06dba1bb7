"""The compiled steps of a trainer: built explicitly, once its first batch
is known (`StepCompiler.build`), as one typed value (`Steps`). Nothing here
sees the trainer or a host batch: the steps are made from `StepParts` and a
`StateLayout`."""

import functools as ft
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks._batch import BatchSpec, Leaf
from .._checks._hooks import HookError
from .._state._sums import NO_FLAGS, EpochSums, SumLayout, sum_order
from .._state._train_state import TrainState
from .._typing import HostMetrics
from ..metrics._statistic import Summed
from ..strategies._placement import (
    put_replicated,
    replicated,
    replicated_copies,
    stacked,
)
from ._forward import InferenceKeyError
from ._hints import first_batch_hint
from ._layout import StateLayout
from ._step import StepParts, build_predict_step, build_steps, several_steps


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


class Steps(NamedTuple):
    """The jitted steps for the batches of one `BatchSpec` (every batch of a
    trainer has its first batch's spec). Each keeps the state where the
    layout's shardings put it; batches may come as NumPy arrays (the input
    shardings place them).

    Attributes:
        train: one update, ``train(leaves, sums, flags, batch, weight,
            total) -> (leaves, EpochSums, step_sums)``; donates the state
            and the epoch's sums (not its flags: the loop waits on an
            earlier step's flags while later steps run).
        train_many: `steps_per_call` updates in one call, on batches stacked
            along a leading steps axis (None with ``steps_per_call=1``).
        evaluate: ``evaluate(leaves, sums, batch, weight) -> sums``, the
            model in inference mode; donates the sums.
        inspect: the train step with its gradient as an output, keeping its
            state (`StepValues`).
        sums: the entries of the packed sums: ``"loss"``, ``"weight"``,
            then the metrics.
        eval_sums: the same of the eval step's sums (its metrics those of
            the trainer's `eval_metrics`, where it has its own).
        outputs: the model's outputs for a batch of the spec, as shapes.
    """

    train: jax.stages.Wrapped
    train_many: jax.stages.Wrapped | None
    evaluate: jax.stages.Wrapped
    inspect: jax.stages.Wrapped
    sums: SumLayout
    eval_sums: SumLayout
    outputs: Any


class StepCompiler:
    """Builds the jitted train, eval and predict steps from `StepParts`.

    `build(spec, size)` is called once, for the first batch (whose spec every
    later batch must have): the model and loss are first traced abstractly
    on that batch (`jax.eval_shape` through the strategy), so a batch that
    does not fit fails with a clear message before anything compiles or
    runs. The predict steps are built per input structure, on first use.
    """

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
        steps_per_call: steps of `Steps.train_many`, one compiled call.
        """
        self.parts = parts
        self.layout = layout
        self._model = model
        self._model_state = model_state
        self.traced_checks = traced_checks
        self.steps_per_call = steps_per_call
        if steps_per_call > 1:  # checked before anything is built
            stacked(parts.strategy.batch_sharding)
        self._predict: dict[Any, jax.stages.Wrapped] = {}
        self._mesh = parts.strategy.mesh
        self._replicated = replicated(self._mesh)

    def build(self, spec: BatchSpec, size: int) -> Steps:
        """The steps for batches of `spec`, checked at a global step of
        `size` examples against the model and loss.

        Raises:
            TypeError, ValueError: the batch does not fit the model or loss.
        """
        parts, layout = self.parts, self.layout
        train, evaluate, probe, inspect = build_steps(
            parts,
            layout,
            spec.treedef,
            spec.traced_check() if self.traced_checks else None,
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
            fix = first_batch_hint(
                spec,
                self._model,
                self._model_state,
                pass_key=parts.pass_key,
                size=size,
            )
            # The model's own error first: the hint is a guess at its cause.
            raise kind(
                f"data: the first batch {spec.describe()} does not fit the model and "
                f"loss: {error}\nHint: {fix}."
            ) from error
        state, split = layout.shardings, parts.strategy.batch_sharding
        rep = self._replicated
        many = None
        if self.steps_per_call > 1:
            steps = stacked(split)
            many = jax.jit(
                _sums_apart(several_steps(train)),
                donate_argnums=(0, 1),
                in_shardings=(state, rep, rep, steps, steps, rep),
                out_shardings=(state, rep, rep),
            )
        return Steps(
            train=jax.jit(
                _sums_apart(train),
                donate_argnums=(0, 1),
                in_shardings=(state, rep, rep, split, split, rep),
                out_shardings=(state, rep, rep),
            ),
            train_many=many,
            evaluate=jax.jit(
                evaluate,
                donate_argnums=(1,),
                in_shardings=(state, rep, split, split),
                out_shardings=rep,
            ),
            inspect=jax.jit(
                _sums_apart(inspect),
                in_shardings=(state, rep, rep, split, split, rep),
                out_shardings=(state, None, rep),
            ),
            sums=sum_layout(sums),
            eval_sums=self._eval_layout(probe, shapes, weight, sums),
            outputs=outputs,
        )

    def _eval_layout(
        self, probe: Any, shapes: Any, weight: Any, sums: dict[str, Any]
    ) -> SumLayout:
        """The entries of the eval step's packed sums: the train step's, or
        those of the trainer's own `eval_metrics` (traced once more)."""
        if self.parts.eval_metrics is not None:
            _, sums = jax.eval_shape(
                ft.partial(probe, inference=True), self.layout.structs, shapes, weight
            )
        return sum_layout(sums)

    def values(
        self,
        steps: Steps,
        leaves: list[jax.Array],
        batch: list[Any],
        weight: Any,
        total: Any,
    ) -> StepValues:
        """What the train step computes from the state `leaves` on a placed
        batch (see `StepValues`); `leaves` stay valid."""
        epoch_sums = self.epoch_sums(steps)
        new, grads, sums = steps.inspect(leaves, *epoch_sums, batch, weight, total)
        host = np.asarray(jax.device_get(sums))
        return StepValues(
            grads, self.step_layout(steps).means(host), self.layout.unflatten(new)
        )

    def predict(self, treedef: Any, leaves: list[Leaf]) -> jax.stages.Wrapped:
        """The jitted predict step for inputs of this structure (validated once)."""
        step = self._predict.get(treedef)
        if step is None:
            strategy = self.parts.strategy
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
            step = self._predict[treedef] = jax.jit(
                fn,
                in_shardings=(self.layout.shardings, strategy.batch_sharding),
                out_shardings=strategy.batch_sharding,
            )
        return step

    def step_layout(self, steps: Steps) -> SumLayout:
        """The entries of a train step's packed sums: the sums', then
        ``"skipped"`` and ``"loss_scale"`` where the step reports them."""
        dynamic = self.parts.precision.loss_scale == "dynamic"
        skip = self.parts.nan_policy == "skip" or dynamic
        extra = ("skipped",) if skip else ()
        return steps.sums.plus(*extra, *(("loss_scale",) if dynamic else ()))

    def epoch_sums(self, steps: Steps) -> EpochSums:
        """Zeroed on-device sums of an epoch, and the non-finite step record."""
        zeros = np.zeros(steps.sums.size, np.float32)
        return EpochSums(*put_replicated((zeros, NO_FLAGS), self._mesh))

    def copy_replicated(self, arrays: list[jax.Array]) -> list[jax.Array]:
        """Copies of `arrays`, replicated on the strategy's devices."""
        return replicated_copies(arrays, self._mesh)

    def eval_sums(self, steps: Steps) -> jax.Array:
        """Zeroed on-device sums of an evaluation."""
        zeros = np.zeros(steps.eval_sums.size, np.float32)
        return put_replicated(zeros, self._mesh)


def _sums_apart(train: Any) -> Any:
    """`train` taking the epoch's sums and flags as two arguments (so that a
    jit can donate the sums alone)."""

    def call(
        leaves: list[jax.Array],
        sums: jax.Array,
        flags: jax.Array,
        batch_leaves: list[Any],
        weight: jax.Array,
        total: jax.Array,
    ) -> Any:
        return train(leaves, EpochSums(sums, flags), batch_leaves, weight, total)

    return call


def sum_layout(sums: dict[str, Any]) -> SumLayout:
    """The entries of packed sums, from the probe's (abstract) per-device
    sums: a mean's a scalar per device, a statistic's its total."""
    names, shapes, readers = [], [], []
    for name in sum_order(sums):
        entry = sums[name]
        names.append(name)
        if isinstance(entry, Summed):
            shapes.append(tuple(entry.total.shape[1:]))
            readers.append(entry.read)
        else:
            shapes.append(())
            readers.append(None)
    return SumLayout(tuple(names), tuple(shapes), tuple(readers))
