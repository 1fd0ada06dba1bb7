"""The compiled steps of a trainer, built once its first batch is known."""

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks._batch import BatchSpec, Leaf
from .._checks._hooks import HookError
from .._state._sums import NO_FLAGS, EpochSums, means, sum_names
from .._state._train_state import TrainState
from .._typing import HostMetrics
from ..strategies._placement import replicated, stacked
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


class CompiledSteps:
    """The jitted train, eval and predict steps, built from `StepParts`.

    The train and eval steps are built when the first batch fixes the
    `BatchSpec` (`validate`). The model and loss are first traced abstractly
    on that batch (`jax.eval_shape` through the strategy), so a batch that
    does not fit fails with a clear message before anything compiles or
    runs. Every step keeps the state where the layout's shardings put it.
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
        steps_per_call: steps of `train_many`, one compiled call.
        """
        self.parts = parts
        self.layout = layout
        self._model = model
        self._model_state = model_state
        self.traced_checks = traced_checks
        self.steps_per_call = steps_per_call
        if steps_per_call > 1:  # checked before anything is built
            stacked(parts.strategy.batch_sharding)
        self.train: Any = None
        # `steps_per_call` train steps in one call, on stacked batches.
        self.train_many: Any = None
        self.evaluate: Any = None
        # The train step with its gradient as an output, not donating its
        # state (`StepValues`); compiled on first use.
        self.inspect: Any = None
        # The order of the packed sums: "loss", "weight", then the metrics.
        self.sum_names: tuple[str, ...] = ()
        self._predict: dict[Any, Any] = {}
        self._replicated = replicated(parts.strategy.mesh)

    def validate(self, spec: BatchSpec, size: int) -> jax.ShapeDtypeStruct:
        """Validate `spec` (at a global step of `size` examples) against the
        model and loss; build the train and eval steps for it.

        Returns:
            The shape of the model's outputs for a batch of this spec.

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
        self.sum_names = sum_names([k for k in sums if k not in ("loss", "weight")])
        # Batches may come as NumPy arrays: the shardings place them.
        state, split = layout.shardings, parts.strategy.batch_sharding
        rep = self._replicated
        # The epoch's flags are not donated: the loop waits on an earlier
        # step's flags while later steps run (`FitLoop.sync`).
        self.train = jax.jit(
            _split_acc(train),
            donate_argnums=(0, 1),
            in_shardings=(state, rep, rep, split, split, rep),
            out_shardings=(state, rep, rep),
        )
        if self.steps_per_call > 1:
            steps = stacked(split)
            self.train_many = jax.jit(
                _split_acc(several_steps(train)),
                donate_argnums=(0, 1),
                in_shardings=(state, rep, rep, steps, steps, rep),
                out_shardings=(state, rep, rep),
            )
        self.evaluate = jax.jit(
            evaluate,
            donate_argnums=(1,),
            in_shardings=(state, rep, split, split),
            out_shardings=rep,
        )
        self.inspect = jax.jit(
            _split_acc(inspect),
            in_shardings=(state, rep, rep, split, split, rep),
            out_shardings=(state, None, rep),
        )
        return outputs

    def values(
        self, leaves: list[jax.Array], batch: list[Any], weight: Any, total: Any
    ) -> StepValues:
        """What the train step computes from the state `leaves` on a placed
        batch (see `StepValues`); `leaves` stay valid."""
        new, grads, sums = self.inspect(leaves, *self.train_acc(), batch, weight, total)
        host = np.asarray(jax.device_get(sums))
        return StepValues(
            grads, means(host, self.step_names), self.layout.unflatten(new)
        )

    def predict(self, treedef: Any, leaves: list[Leaf]) -> Any:
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

    @property
    def step_names(self) -> tuple[str, ...]:
        """The names of a train step's packed sums."""
        dynamic = self.parts.precision.loss_scale == "dynamic"
        skip = self.parts.nan_policy == "skip" or dynamic
        names = (*self.sum_names, "skipped") if skip else self.sum_names
        return (*names, "loss_scale") if dynamic else names

    def train_acc(self) -> EpochSums:
        """Zeroed on-device sums of an epoch, and the non-finite step record."""
        zeros = np.zeros(len(self.sum_names), np.float32)
        return EpochSums(*jax.device_put((zeros, NO_FLAGS), self._replicated))

    def copy_replicated(self, arrays: list[jax.Array]) -> list[jax.Array]:
        """Copies of `arrays`, replicated on the strategy's devices."""
        return jax.device_put([jnp.copy(x) for x in arrays], self._replicated)

    def eval_acc(self) -> jax.Array:
        """Zeroed on-device sums of an evaluation."""
        zeros = np.zeros(len(self.sum_names), np.float32)
        return jax.device_put(zeros, self._replicated)


def _split_acc(train: Any) -> Any:
    """`train` taking the epoch's sums and flags as two arguments (so that a
    jit can donate the sums alone)."""

    def call(leaves, sums, flags, batch_leaves, weight, total):
        return train(leaves, EpochSums(sums, flags), batch_leaves, weight, total)

    return call
