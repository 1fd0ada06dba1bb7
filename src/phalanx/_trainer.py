from collections.abc import Iterable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, Float, PyTree

from . import _losses
from ._batching import BatchPipeline, pad
from ._checks import BatchSpec, flatten_batch, num_examples
from ._config import check_config, check_duration, check_iterable
from ._forward import takes_key
from ._state import TrainState
from ._step import build_predict_step, build_steps
from ._typing import (
    ChecksMode,
    DeviceMetrics,
    HostMetrics,
    LossFn,
    LossName,
    NanPolicy,
    validates_own_arguments,
)
from .callbacks import Callback, StepInfo
from .callbacks._callback import overrides
from .strategies import ShardingStrategy, Strategy


class DataParallelTrainer:
    """Trains an Equinox model with optax on every device a strategy holds.

    The trainer is the loop: it checks and pads each host batch, runs the
    strategy's compiled step (state buffers donated, at most `sync_every`
    steps in flight), and calls the callbacks. Every update equals one
    device's update on the whole batch.

    This is the one class meant for subclassing. Override these hooks; each
    runs inside the compiled step (trace time), so keep them pure:

    - `split_batch(batch) -> (inputs, targets)`: default takes an ``(x, y)`` pair.
    - `loss(model, outputs, targets) -> Float[Array, "batch"]`: one value per
      example; default from ``loss=``. Add regularisers here.
    - `metrics(outputs, targets) -> dict[str, Float[Array, "batch"]]`:
      per-example values averaged with the same weights as the loss; default
      accuracy for cross-entropy.
    - `gradients(grads, state) -> grads`: the reduced, averaged gradients
      before the optimizer; default unchanged.

    Example:
        ```python
        model = px.models.MLP(64, 10, key=jax.random.key(0))
        trainer = px.DataParallelTrainer(model, optax.adam(1e-3))
        trainer.fit([(x, y)], epochs=5)
        trainer.evaluate([(x_test, y_test)])  # {"loss": ..., "accuracy": ...}
        ```
    """

    @validates_own_arguments
    def __init__(
        self,
        model: eqx.Module,
        optimizer: optax.GradientTransformation,
        *,
        strategy: Strategy | None = None,
        loss: LossName | LossFn = "cross_entropy",
        callbacks: Sequence[Callback] = (),
        seed: int = 0,
        model_state: eqx.nn.State | None = None,
        checks: ChecksMode = "on",
        nan_policy: NanPolicy = "raise",
        sync_every: int = 16,
    ):
        """Args:
        model: a per-example Equinox model; it may take a ``key`` keyword
            (the trainer passes a fresh one per example and step) and, with
            ``model_state``, be called as ``model(x, state) -> (y, state)``.
        optimizer: any optax gradient transformation.
        strategy: how steps run across devices; default
            `ShardingStrategy()` over all local devices.
        loss: ``"cross_entropy"`` (integer labels; reports accuracy),
            ``"mse"``, or ``fn(outputs, targets) -> per-example losses``.
        callbacks: host-side `Callback`s, called in order.
        seed: seeds the PRNG key of the run (dropout, ...).
        model_state: the `eqx.nn.State` of stateful layers, from
            `eqx.nn.make_with_state`.
        checks: ``"on"`` checks every batch on the host (structure and
            shapes once per signature, values every batch); ``"off"`` skips
            the value checks.
        nan_policy: on a non-finite gradient, ``"raise"`` (naming the leaf and
            step; state kept as before that step), ``"skip"`` the update
            (counted in the ``skipped_steps`` metric), or ``"off"``.
        sync_every: the host waits for the device at least every this many
            steps, bounding memory and error latency.

        Raises:
            TypeError, ValueError: an argument is invalid (the message names it).
        """
        check_config(
            model=model,
            optimizer=optimizer,
            strategy=strategy,
            loss=loss,
            callbacks=callbacks,
            seed=seed,
            model_state=model_state,
            checks=checks,
            nan_policy=nan_policy,
            sync_every=sync_every,
        )
        self.strategy: Strategy = ShardingStrategy() if strategy is None else strategy
        self.optimizer = optimizer
        self.callbacks: tuple[Callback, ...] = tuple(callbacks)
        self.checks = checks
        self.nan_policy = nan_policy
        self.sync_every = sync_every
        self.history: list[HostMetrics] = []
        self._loss_name = loss if isinstance(loss, str) else None
        builtin = {"cross_entropy": _losses.cross_entropy, "mse": _losses.mse}
        self._loss_fn: LossFn = builtin[loss] if isinstance(loss, str) else loss
        self._pass_key = takes_key(model)
        state = TrainState(
            jnp.asarray(0, jnp.int32),
            model,
            optimizer.init(eqx.filter(model, eqx.is_inexact_array)),
            jr.key(seed),
            model_state,
        )
        dynamic, self._state_static = eqx.partition(state, eqx.is_array)
        leaves, self._state_treedef = jax.tree.flatten(dynamic)
        replicated = self.strategy.replicated
        self._leaves: list[jax.Array] = jax.device_put(leaves, replicated)
        # Copies the state before a loop donates it, so states handed out stay valid
        # (NOTES trap 5: device_put may share the user's own buffers).
        self._copy = jax.jit(
            lambda xs: [jnp.copy(x) for x in xs], out_shardings=replicated
        )
        self._step = 0
        self._epoch = 0
        self._metric_names: tuple[str, ...] = ()
        self._train_step: Any = None
        self._eval_step: Any = None
        self._predict_steps: dict[Any, Any] = {}
        self._batches = BatchPipeline(
            self.strategy,
            value_checks=checks == "on",
            labels_of=(lambda b: self.split_batch(b)[1])
            if self._loss_name == "cross_entropy"
            else None,
            on_spec=self._on_spec,
        )

    # ----------------------------------------------------------------- hooks

    def split_batch(self, batch: PyTree) -> tuple[PyTree, PyTree]:
        """Split a batch into model inputs and loss targets (default: ``(x, y)``)."""
        if isinstance(batch, tuple | list) and len(batch) == 2:
            return batch[0], batch[1]
        raise TypeError(
            f"data: a batch must be an (x, y) pair, got {type(batch).__name__} of "
            f"structure {jax.tree.structure(batch)}; yield (x, y) pairs or override "
            "DataParallelTrainer.split_batch"
        )

    def loss(
        self, model: eqx.Module, outputs: PyTree, targets: PyTree
    ) -> Float[Array, " batch"]:
        """Per-example loss; ``model`` is there for regularisers."""
        del model
        return self._loss_fn(outputs, targets)

    def metrics(
        self, outputs: PyTree, targets: PyTree
    ) -> dict[str, Float[Array, " batch"]]:
        """Per-example metrics, averaged like the loss (default: accuracy for CE)."""
        if self._loss_name == "cross_entropy":
            return {"accuracy": _losses.accuracy(outputs, targets)}
        return {}

    def gradients(self, grads: PyTree, state: TrainState) -> PyTree:
        """Transform the global mean gradient before the optimizer (default: none)."""
        del state
        return grads

    # ---------------------------------------------------------------- public

    @property
    def state(self) -> TrainState:
        """The current `TrainState` (replicated device arrays)."""
        return eqx.combine(
            jax.tree.unflatten(self._state_treedef, self._leaves), self._state_static
        )

    @property
    def model(self) -> eqx.Module:
        """The current model."""
        return self.state.model

    @validates_own_arguments
    def fit(
        self,
        data: Iterable[Any],
        *,
        epochs: int | None = None,
        steps: int | None = None,
        eval_data: Iterable[Any] | None = None,
    ) -> TrainState:
        """Train on `data`, a re-iterable of host batches, in the order given.

        Args:
            data: batches, each a pytree of arrays with a shared leading
                examples axis, e.g. ``(x, y)``. The last may be shorter.
            epochs: passes over `data` (default 1 when `steps` is not given).
            steps: optimizer updates to make, re-iterating `data` as needed.
                With both, training stops at whichever comes first.
            eval_data: batches to `evaluate` after every epoch (metrics
                reported with an ``eval_`` prefix).

        Returns:
            The final `TrainState`.

        Raises:
            ValueError, TypeError: bad arguments or batches, before any update
                they concern; the state is that of the last good step.
            FloatingPointError: a non-finite gradient under nan_policy="raise".
        """
        epochs, steps = check_duration(epochs, steps)
        check_iterable(data, "data")
        if eval_data is not None:
            check_iterable(eval_data, "eval_data")
        self._leaves = self._copy(self._leaves)
        last = None if steps is None else self._step + steps
        self._notify("on_fit_start", self._info())
        try:
            for _ in range(epochs) if epochs is not None else iter(int, 1):
                self._run_epoch(data, last, eval_data)
                if last is not None and self._step >= last:
                    break
        except BaseException as error:
            for callback in self.callbacks:
                callback.on_exception(self._info(), error)
            raise
        self._notify("on_fit_end", self._info())
        return self.state

    @validates_own_arguments
    def evaluate(self, data: Iterable[Any]) -> HostMetrics:
        """Loss and metrics over every example of `data`, weighted exactly.

        Returns:
            ``{"loss": ..., **metrics}`` as floats.
        """
        check_iterable(data, "data")
        acc: Any = None
        first = None
        for i, batch in enumerate(data):
            leaves, weight, first = self._batches.prepare(batch, f"batch {i}", first)
            if acc is None:
                acc = self._zeros(("loss", "weight", *self._metric_names))
            acc = self._eval_step(self._leaves, acc, leaves, weight)
            if (i + 1) % self.sync_every == 0:
                jax.block_until_ready(acc)
        if acc is None:
            raise ValueError(_empty_message("data"))
        sums = jax.device_get(acc)
        results = {
            k: float(v / sums["weight"]) for k, v in sums.items() if k != "weight"
        }
        self._notify("on_eval_end", self._info(results))
        return results

    @validates_own_arguments
    def predict(self, x: PyTree, *, batch_size: int | None = None) -> PyTree[jax.Array]:
        """Model outputs (inference mode) for every row of `x`, in order.

        Rows are split across devices; any number works (padding is added
        and removed). With `batch_size`, rows go through in chunks of that
        size (one compilation for all chunks).
        """
        leaves, treedef = flatten_batch(x, "x")
        n = num_examples(leaves, treedef, "x")
        chunk = n if batch_size is None else batch_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(
                f"batch_size={batch_size!r} must be a positive int or None"
            )
        step = self._predict_step(treedef, leaves)
        size = self._batches.step_size(min(chunk, n), None)
        outputs = []
        for start in range(0, n, chunk):
            part = [leaf[start : start + chunk] for leaf in leaves]
            out = step(self._leaves, self.strategy.shard(pad(part, size)))
            outputs.append(jax.tree.map(lambda o, k=part[0].shape[0]: o[:k], out))
        if len(outputs) == 1:
            return outputs[0]
        return jax.tree.map(lambda *os: jnp.concatenate(os), *outputs)

    def lower(self, batch: PyTree) -> jax.stages.Lowered:
        """The train step lowered for `batch`, to inspect what it compiles to.

        Example:
            ```python
            hlo = trainer.lower((x, y)).compile().as_text()
            ```
        """
        leaves, weight, _ = self._batches.prepare(batch, "batch", None)
        return self._train_step.lower(
            self._leaves, self._new_train_acc(), leaves, weight
        )

    # -------------------------------------------------------------- the loop

    def _run_epoch(self, data: Iterable[Any], last: int | None, eval_data: Any) -> None:
        epoch = self._epoch
        self._notify("on_epoch_start", self._info())
        step_hooks = [c for c in self.callbacks if overrides(c, "on_step_end")]
        acc: Any = None
        first = None
        for i, batch in enumerate(data):
            leaves, weight, first = self._batches.prepare(
                batch, f"batch {i} of epoch {epoch}", first
            )
            if acc is None:
                acc = self._new_train_acc()
            self._leaves, acc, metrics = self._train_step(
                self._leaves, acc, leaves, weight
            )
            self._step += 1
            if self._step % self.sync_every == 0:
                self._sync(acc)
            for callback in step_hooks:
                callback.on_step_end(StepInfo(self, self._step, epoch, metrics))
            if last is not None and self._step >= last:
                break
        if acc is None:
            raise ValueError(_empty_message("data", epoch))
        logs = self._epoch_logs(jax.device_get(acc))
        if eval_data is not None:
            logs.update({f"eval_{k}": v for k, v in self.evaluate(eval_data).items()})
        self.history.append(logs)
        self._epoch += 1
        self._notify("on_epoch_end", StepInfo(self, self._step, epoch, logs))

    def _sync(self, acc: dict[str, jax.Array]) -> None:
        """Wait for the device (bounded in-flight window); surface a bad step."""
        if self.nan_policy == "raise":
            self._raise_if_nonfinite(jax.device_get(acc))
        else:
            jax.block_until_ready(acc["skipped"])

    def _epoch_logs(self, sums: dict[str, Any]) -> HostMetrics:
        self._raise_if_nonfinite(sums)
        logs = {
            k: float(sums[k] / sums["weight"]) for k in ("loss", *self._metric_names)
        }
        if self.nan_policy == "skip":
            logs["skipped_steps"] = float(sums["skipped"])
        return logs

    def _raise_if_nonfinite(self, sums: dict[str, Any]) -> None:
        bad_step = int(sums["nonfinite_step"])
        if bad_step < 0:
            return
        self._step = bad_step
        paths = jax.tree_util.tree_flatten_with_path(
            eqx.filter(self.state.model, eqx.is_inexact_array)
        )[0]
        leaf = "model" + jax.tree_util.keystr(paths[int(sums["nonfinite_leaf"])][0])
        raise FloatingPointError(
            f"non-finite gradient (NaN or inf) in {leaf} at step {bad_step} "
            "(nan_policy='raise'); the state is kept as it was before that step. "
            "Lower the learning rate, clip gradients (optax.clip_by_global_norm), "
            "check the data, or pass nan_policy='skip' to skip such updates"
        )

    # ------------------------------------------------------------ set-up

    def _on_spec(self, spec: BatchSpec, leaves: list[np.ndarray]) -> None:
        """Validate the first batch against the model and loss; build the steps."""
        if self._loss_name == "cross_entropy":
            labels = self.split_batch(jax.tree.unflatten(spec.treedef, leaves))[1]
            if not isinstance(labels, np.ndarray) or labels.dtype.kind not in "iu":
                raise TypeError(
                    "data: labels y have dtype "
                    f"{getattr(labels, 'dtype', type(labels))}; loss='cross_entropy' "
                    "needs integer class labels, e.g. "
                    "y.astype(np.int32) (or use loss='mse' for regression)"
                )

        train, evaluate, probe = build_steps(
            self,
            self._state_treedef,
            self._state_static,
            spec.treedef,
            spec.traced_check() if self.checks == "on" else None,
            self._pass_key,
        )
        size = self._batches.step_size(leaves[0].shape[0], None)
        shapes = [
            jax.ShapeDtypeStruct((size, *shape), dtype)
            for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
        ]
        try:
            outputs, sums = jax.eval_shape(
                probe, self._leaves, shapes, jax.ShapeDtypeStruct((size,), jnp.float32)
            )
        except (TypeError, ValueError) as error:
            kind = TypeError if isinstance(error, TypeError) else ValueError
            raise kind(
                f"data: the first batch {spec.describe()} does not fit the model and "
                f"loss; fix the batch or the model. The error was: {error}"
                + _hint(error)
            ) from error
        if self._loss_name == "cross_entropy":
            self._batches.num_classes = int(outputs.shape[-1])
        self._metric_names = tuple(k for k in sums if k not in ("loss", "weight"))
        replicated = self.strategy.replicated
        self._train_step = jax.jit(
            train, donate_argnums=(0, 1), out_shardings=replicated
        )
        self._eval_step = jax.jit(
            evaluate, donate_argnums=(1,), out_shardings=replicated
        )

    def _predict_step(self, treedef: Any, leaves: list[np.ndarray]) -> Any:
        step = self._predict_steps.get(treedef)
        if step is None:
            fn = build_predict_step(
                self, self._state_treedef, self._state_static, treedef, self._pass_key
            )
            step = jax.jit(fn, out_shardings=self.strategy.split)
            rows = self.strategy.num_devices
            shapes = [
                jax.ShapeDtypeStruct((rows, *leaf.shape[1:]), leaf.dtype)
                for leaf in leaves
            ]
            try:
                jax.eval_shape(fn, self._leaves, shapes)
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"x: rows of shapes {[leaf.shape[1:] for leaf in leaves]} do "
                    "not fit the model; pass rows the model accepts. "
                    f"The error was: {error}"
                ) from error
            self._predict_steps[treedef] = step
        return step

    def _new_train_acc(self) -> dict[str, jax.Array]:
        acc = self._zeros(("loss", "weight", *self._metric_names))
        extra = {"skipped": 0, "nonfinite_step": -1, "nonfinite_leaf": -1}
        acc.update(
            jax.device_put(
                {k: np.int32(v) for k, v in extra.items()}, self.strategy.replicated
            )
        )
        return acc

    def _zeros(self, names: Iterable[str]) -> dict[str, jax.Array]:
        return jax.device_put(
            {k: np.float32(0) for k in names}, self.strategy.replicated
        )

    def _info(self, metrics: DeviceMetrics | HostMetrics | None = None) -> StepInfo:
        return StepInfo(self, self._step, self._epoch, metrics or {})

    def _notify(self, hook: str, info: StepInfo) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(info)


def _hint(error: Exception) -> str:
    """Known causes of errors from inside the model, and their fixes."""
    if "Old and new values have different structures" in str(error):
        # eqx.nn.State.set compares a fresh constant (BatchNorm mode="ema" sets
        # jnp.array(False)) against a value typed with shard_map's mesh under
        # JAX 0.10, and the two never match (equinox 0.13.8).
        return (
            ". A stateful layer that writes a constant into eqx.nn.State cannot "
            "run inside jax.shard_map (PmapStrategy, AccumulatingStrategy) with "
            "this equinox; for BatchNorm pass mode='batch' (equinox's advice for "
            "new code), or train with ShardingStrategy"
        )
    return ""


def _empty_message(name: str, epoch: int | None = None) -> str:
    where = "" if epoch is None else f" in epoch {epoch}"
    return (
        f"{name}: yielded no batches{where}; pass a non-empty re-iterable such as a "
        "list of (x, y) batches (a generator is used up after one pass: wrap it in "
        "a class whose __iter__ makes a new one)"
    )
