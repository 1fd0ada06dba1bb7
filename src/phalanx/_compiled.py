from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import BatchSpec, Leaf
from ._hints import first_batch_hint
from ._hook_checks import HookError
from ._step import build_predict_step, build_steps
from ._sums import NO_FLAGS, EpochSums, sum_names


if TYPE_CHECKING:
    from ._trainer import DataParallelTrainer


class CompiledSteps:
    """A trainer's jitted train, eval and predict steps.

    They are built when the first batch fixes the `BatchSpec`. The model and
    loss are first traced abstractly on that batch (`jax.eval_shape` through
    the strategy), so a batch that does not fit fails with a clear message
    before anything compiles or runs.
    """

    def __init__(
        self,
        trainer: "DataParallelTrainer",
        state_treedef: Any,
        state_static: Any,
        *,
        pass_key: bool,
        traced_checks: bool,
    ):
        self.trainer = trainer
        self.state_treedef = state_treedef
        self.state_static = state_static
        self.pass_key = pass_key
        self.traced_checks = traced_checks
        self.train: Any = None
        self.evaluate: Any = None
        # The order of the packed sums: "loss", "weight", then the metrics
        # (set by `build`, or by a restored checkpoint of a part-done epoch).
        self.sum_names: tuple[str, ...] = ()
        self._predict: dict[Any, Any] = {}

    @property
    def replicated(self) -> jax.sharding.NamedSharding:
        return self.trainer.strategy.replicated

    def build(
        self, spec: BatchSpec, state_leaves: list[jax.Array], size: int
    ) -> jax.ShapeDtypeStruct:
        """Validate `spec` (at a step of `size` examples) against the model and
        loss; build the train and eval steps.

        Returns:
            The shape of the model's outputs for a batch of this spec.

        Raises:
            TypeError, ValueError: the batch does not fit the model or loss.
        """
        train, evaluate, probe = build_steps(
            self.trainer,
            self.state_treedef,
            self.state_static,
            spec.treedef,
            spec.traced_check() if self.traced_checks else None,
            self.pass_key,
        )
        shapes = [
            jax.ShapeDtypeStruct((size, *shape), dtype)
            for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
        ]
        weight = jax.ShapeDtypeStruct((size,), jnp.float32)
        try:
            outputs, sums = jax.eval_shape(probe, state_leaves, shapes, weight)
        except HookError:
            raise  # not the batch's fault: its own message names the hook
        except (TypeError, ValueError, IndexError) as error:
            kind = TypeError if isinstance(error, TypeError) else ValueError
            state = self.trainer.state
            fix = first_batch_hint(
                spec,
                state.model,
                state.model_state,
                pass_key=self.pass_key,
                size=size,
            )
            raise kind(
                f"data: the first batch {spec.describe()} does not fit the model and "
                f"loss; {fix}. The error was: {error}"
            ) from error
        self.sum_names = sum_names([k for k in sums if k not in ("loss", "weight")])
        # Batches may come as NumPy arrays: the shardings place them.
        replicated, split = self.replicated, self.trainer.strategy.split
        self.train = jax.jit(
            train,
            donate_argnums=(0, 1),
            in_shardings=(replicated, replicated, split, split, replicated),
            out_shardings=replicated,
        )
        self.evaluate = jax.jit(
            evaluate,
            donate_argnums=(1,),
            in_shardings=(replicated, replicated, split, split),
            out_shardings=replicated,
        )
        return outputs

    def predict(
        self, treedef: Any, leaves: list[Leaf], state_leaves: list[jax.Array]
    ) -> Any:
        """The jitted predict step for inputs of this structure (validated once)."""
        step = self._predict.get(treedef)
        if step is None:
            strategy = self.trainer.strategy
            fn = build_predict_step(
                self.trainer,
                self.state_treedef,
                self.state_static,
                treedef,
                self.pass_key,
            )
            shapes = [
                jax.ShapeDtypeStruct(
                    (strategy.num_devices, *leaf.shape[1:]), leaf.dtype
                )
                for leaf in leaves
            ]
            try:
                jax.eval_shape(fn, state_leaves, shapes)
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"x: rows of shapes {[leaf.shape[1:] for leaf in leaves]} do "
                    "not fit the model; pass rows the model accepts. "
                    f"The error was: {error}"
                ) from error
            step = self._predict[treedef] = jax.jit(fn, out_shardings=strategy.split)
        return step

    @property
    def step_names(self) -> tuple[str, ...]:
        """The names of a train step's packed sums."""
        skip = self.trainer.nan_policy == "skip"
        return (*self.sum_names, "skipped") if skip else self.sum_names

    def train_acc(self) -> EpochSums:
        """Zeroed on-device sums of an epoch, and the non-finite step record."""
        zeros = np.zeros(len(self.sum_names), np.float32)
        return EpochSums(*jax.device_put((zeros, NO_FLAGS), self.replicated))

    def eval_acc(self) -> jax.Array:
        """Zeroed on-device sums of an evaluation."""
        zeros = np.zeros(len(self.sum_names), np.float32)
        return jax.device_put(zeros, self.replicated)
