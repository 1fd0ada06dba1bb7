"""The compiled train, eval and predict steps: split, compute, reduce once, update.

Each step is a `jax.jit` function of flat lists of arrays (not `eqx.filter_jit`,
which waits on every call, so host work would never overlap device work):
the state's leaves, an on-device accumulator of the epoch's sums, and the
batch's leaves with per-example weights (0 for padding). The train step also
takes the batch's total weight, known before the step runs: the gradient is
of Σ weight · loss / total, so the division happens once, on the loss's
cotangent, instead of on every gradient leaf after the reduction.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from jaxtyping import PyTree

from .._checks._batch import ZERO_WEIGHT
from .._checks._calls import call_mistake
from .._checks._hooks import (
    HookTypeError,
    HookValueError,
    check_gradients,
    check_metrics,
    check_per_example,
    check_statistic,
    loss_values,
    returned,
)
from .._precision import Precision
from .._state._sums import EpochSums, sum_order
from .._state._train_state import DynamicScale, TrainState
from .._typing import NanPolicy
from ..metrics._labels import MetricArgumentError
from ..metrics._named import RESERVED_NAMES
from ..metrics._statistic import LossResult, Metrics, Statistic, Summed
from ..strategies import Strategy
from ._forward import example_keys, forward, infer
from ._groups import Groups, check_group_losses, group_gradients, own_loss
from ._layout import StateLayout
from ._use import constrained, used_as


class StepParts(NamedTuple):
    """What the compiled steps are built from.

    Attributes:
        loss: ``loss(model, outputs, targets) -> per-example losses``, or
            ``(per-example losses, {name: per-example values or statistic})``.
        metrics: ``metrics(outputs, targets) -> {name: per-example values or
            statistic}``.
        gradients: ``gradients(grads, state) -> grads``, before the optimizer.
        optimizer: the optax transformation.
        strategy: how the step runs across devices.
        nan_policy: what a non-finite gradient does (see the trainer).
        pass_key: whether the model takes a ``key``.
        precision: the dtypes the step computes in.
        inference_model: ``inference_model(model) -> callable``: how the eval
            and predict steps call the model (already in inference mode).
        eval_metrics: ``eval_metrics(outputs, targets) -> {name: per-example
            values}`` in the eval step; None: `metrics`, as in training.
        ema: the decay of the parameters' moving average, which the state
            keeps and the eval and predict steps use; None: none.
        groups: the parameter groups, where the optimizer has several
            (`Groups`); None: one optimizer for every parameter.
    """

    loss: Callable[[Any, Any, Any], LossResult]
    metrics: Callable[[Any, Any], Metrics]
    gradients: Callable[[PyTree, TrainState], PyTree]
    optimizer: optax.GradientTransformation
    strategy: Strategy
    nan_policy: NanPolicy
    pass_key: bool
    precision: Precision = Precision()
    inference_model: Callable[[Any], Any] = lambda model: model
    eval_metrics: Callable[[Any, Any], Metrics] | None = None
    ema: float | None = None
    groups: Groups | None = None


def _split_model(model: eqx.Module) -> tuple[Any, Any, Any]:
    """Trainable parameters, other arrays, and the static rest of a model."""
    params, others = eqx.partition(model, eqx.is_inexact_array)
    arrays, static = eqx.partition(others, eqx.is_array)
    return params, arrays, static


def weighted_sums(
    parts: StepParts,
    model: Any,
    outputs: Any,
    targets: Any,
    weight: jax.Array,
    *,
    evaluating: bool = False,
) -> dict[str, Any]:
    """Σ weight · loss, Σ weight, and each metric's sum over this slice:
    Σ weight · value for per-example values, a `Summed` total for a
    statistic. The metrics are the loss's own values, then those of the
    `metrics` hook (`evaluating`: of `eval_metrics`, where the trainer has
    its own)."""
    losses, values = loss_values(
        _call_hook("loss", parts.loss, model, outputs, targets)
    )
    sums: dict[str, Any] = {"weight": jnp.sum(weight)}
    if isinstance(losses, Mapping):  # one per group
        own = check_group_losses(losses, parts.groups)
        for group, name in own:
            check_per_example(losses[group], weight, f"loss[{group!r}]")
            sums[name] = jnp.sum(weight * losses[group])
        sums["loss"] = sum(sums[name] for _, name in own)
    else:
        check_per_example(losses, weight, "loss")
        sums["loss"] = jnp.sum(weight * losses)
    hook, metrics_of = "metrics", parts.metrics
    if evaluating and parts.eval_metrics is not None:
        hook, metrics_of = "eval_metrics", parts.eval_metrics
    metrics = _call_hook(hook, metrics_of, outputs, targets)
    check_metrics(metrics, hook)
    for source, named in (("loss", values), (f"{hook}()", metrics)):
        for name, value in named.items():
            _check_name(name, source, sums)
            if isinstance(value, Statistic):
                check_statistic(value, weight, f"{source}[{name!r}]")
                sums[name] = Summed.of(value, weight.astype(jnp.float32))
            else:
                check_per_example(value, weight, f"{source}[{name!r}]")
                sums[name] = jnp.sum(weight * value.astype(weight.dtype))
    return sums


def _call_hook(hook: str, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)`, the trainer's `hook`, with its mistakes told as
    the hook's (not the batch's): a `px.metrics` function's complaint about
    its arguments, and a call (of the hook, or made by it) whose arguments
    do not fit the callee's signature."""
    try:
        return function(*args)
    except MetricArgumentError as error:
        raise HookValueError(f"{hook}(): {error}") from error
    except TypeError as error:
        # The traceback starts at this frame, so the hook's own signature is
        # told from the calls it makes.
        mistake = call_mistake(error, hook)
        if mistake is None:
            raise
        raise mistake from error


def _check_name(name: str, source: str, sums: dict[str, Any]) -> None:
    """A metric's name must be free: not the trainer's, not one the loss's
    values already gave."""
    if name in RESERVED_NAMES:
        raise HookValueError(
            f"{source} returned a metric named {name!r}, a name the trainer "
            f"reports itself ({', '.join(RESERVED_NAMES)}); rename it, e.g. "
            f"{name + '_metric'!r}"
        )
    if name in sums:
        raise HookValueError(
            f"{source} returned a metric named {name!r}, which the loss's values "
            "already hold; rename one of them"
        )


def inference_call(parts: StepParts, model: Any) -> Callable[..., Any]:
    """How the eval and predict steps call `model` (in inference mode), as
    the trainer's `inference_model` hook says, checked at trace time."""
    call = parts.inference_model(model)
    if not callable(call):
        raise HookTypeError(
            f"inference_model returned {returned(call)}; it must return how to "
            "call the model at inference: the model itself, or e.g. "
            "functools.partial(model, enable_dropout=False)"
        )
    return call


def _packed(sums: dict[str, Any]) -> jax.Array:
    """A slice's sums as one vector (one operand of the reduction)."""
    return jnp.concatenate(
        [
            jnp.ravel(s.total if isinstance(s, Summed) else s)
            for s in (sums[name] for name in sum_order(sums))
        ]
    )


class StepFunctions(NamedTuple):
    """The step functions for one batch structure (not yet jitted).

    Attributes:
        train: ``train(leaves, epoch_sums, batch_leaves, weight, total) -> (leaves,
            epoch_sums, sums)``: one update.
        evaluate: ``evaluate(leaves, epoch_sums, batch_leaves, weight) -> epoch_sums``.
        probe: ``probe(leaves, batch_leaves, weight, inference=False) ->
            (outputs, sums)``: the model and loss mapped over a batch through
            the strategy (as the eval step runs them, with `inference`),
            per-example outputs and per-device sums; `jax.eval_shape` of it
            validates a batch against the model before anything is compiled,
            and names the sums.
        inspect: ``inspect(leaves, epoch_sums, batch_leaves, weight, total) ->
            (leaves, grads, sums)``: `train` with the gradient it applied
            (reduced, after the `gradients` hook) as an output, for
            `DataParallelTrainer.compute_step`.
    """

    train: Callable
    evaluate: Callable
    probe: Callable
    inspect: Callable


def build_steps(
    parts: StepParts,
    layout: StateLayout,
    batch_treedef: Any,
    batch_check: Callable[[tuple[jax.Array, ...], jax.Array], None] | None,
) -> StepFunctions:
    """The step functions for one batch structure."""
    strategy, pass_key, unflatten = parts.strategy, parts.pass_key, layout.unflatten
    precision = parts.precision
    cast = precision.cast
    # Under a mixed policy the gradients cross devices as the policy says:
    # per device (one explicit reduction of each device's gradient, in
    # `precision.reduce`), not where a compiler puts it in a global view,
    # where the strategy declares a per-device program. (One device has
    # nothing to reduce: its global view is its own.)
    per_device = (
        strategy.per_device_reduce()
        if precision.mixed and strategy.num_devices > 1
        else None
    )
    reduce = strategy.reduce if per_device is None else per_device

    # Where the strategy lays out the reduced gradient (None: as `reduce`
    # leaves it), given where each of the model's arrays lives.
    stored = jax.tree.unflatten(layout.treedef, layout.shardings).model
    grad_shardings = strategy.gradient_shardings(stored)
    # Where the step computes with each parameter (None: where it lies; a
    # per-device program gathers each whole over the batch axes itself).
    use_shardings = strategy.use_shardings(stored) if per_device is None else None

    def examples(batch_leaves, weight):
        if batch_check is not None:
            batch_check(tuple(batch_leaves), weight)
        batch = jax.tree.unflatten(batch_treedef, batch_leaves)
        return batch, weight, jnp.arange(weight.shape[0])

    def run(static, params, replicated, model_state, examples, inference=False):
        """Model, loss and metrics on a slice: (weighted sums, outputs, state).
        With `inference`, the model is called as `inference_model` says,
        without randomness."""
        arrays, key = replicated
        batch, weight, index = examples
        inputs, targets = batch
        model = eqx.combine(params, arrays, static)
        computing = eqx.combine(cast(params, precision.compute), arrays, static)
        if use_shardings is not None and not inference:
            computing = used_as(computing, use_shardings)
        # Model state (BatchNorm statistics) is kept in its own dtype and
        # used in the compute dtype, as the layers it feeds.
        compute_state = cast(model_state, precision.compute)
        if inference:
            new_state = infer(
                inference_call(parts, computing),
                cast(inputs, precision.compute),
                state=compute_state,
            )
        else:
            new_state = forward(
                computing,
                cast(inputs, precision.compute),
                state=compute_state,
                keys=example_keys(key, index),
                pass_key=pass_key,
            )
        outputs = cast(new_state[0], precision.output)
        model_state = jax.tree.map(
            lambda new, old: new.astype(old.dtype) if eqx.is_array(new) else new,
            new_state[1],
            model_state,
        )
        sums = weighted_sums(
            parts, model, outputs, targets, weight, evaluating=inference
        )
        return sums, outputs, model_state

    def gradient(state, batch_leaves, weight, total):
        """The step's reduced gradient, as the optimizer gets it, its packed
        sums, the new model state and the next key."""
        params, arrays, static = _split_model(state.model)
        if pass_key:
            step_key, next_key = jr.split(state.key)
        else:  # nothing draws random numbers: spare every device the hashing
            step_key = next_key = state.key

        # The loss is multiplied by this before differentiation (None: 1).
        scale = _loss_scale(precision, state.loss_scale)

        def local(replicated, model_state, examples):
            params, rest, total, scale = replicated

            def objective(params):
                sums, _, new_state = run(static, params, rest, model_state, examples)
                loss = own_loss(sums, parts.groups) / total
                return loss if scale is None else loss * scale, (
                    _packed(sums),
                    new_state,
                )

            if parts.groups is None:
                grads, (sums, model_state) = jax.grad(objective, has_aux=True)(params)
            else:
                grads, (sums, model_state) = group_gradients(
                    objective, params, parts.groups
                )
            return (cast(grads, precision.reduce), sums), model_state

        (grads, sums), model_state = reduce(
            local,
            (params, (arrays, step_key), total, scale),
            state.model_state,
            examples(batch_leaves, weight),
        )
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        if grad_shardings is not None:  # where the strategy lays them out
            grads = constrained(grads, grad_shardings)
        if scale is not None:
            grads = jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)
        grads = parts.gradients(grads, state)
        check_gradients(grads, params)
        return grads, sums, model_state, next_key

    def step(leaves, epoch_sums, batch_leaves, weight, total):
        """One update: the train step's outputs, and the gradient it applied."""
        state = unflatten(leaves)
        params = eqx.filter(state.model, eqx.is_inexact_array)
        grads, sums, model_state, next_key = gradient(
            state, batch_leaves, weight, total
        )

        def apply(loss_scale: DynamicScale | None) -> list[jax.Array]:
            updates, opt_state = parts.optimizer.update(grads, state.opt_state, params)
            # The rate multiplier (`TrainState.lr_scale`), on the final update:
            # the rate of optax's optimizers, exactly. At 1.0 it changes no
            # value (x * 1 == x), though XLA:CPU's LLVM then rounds a traced
            # rate's product before adding it to the parameter instead of
            # fusing the two: an injected or scheduled rate's update can
            # differ by an ulp from phalanx before the multiplier (a
            # constant rate's is bitwise the same; measured, 12 adam steps).
            updates = jax.tree.map(
                lambda u: u * state.lr_scale.astype(u.dtype), updates
            )
            new = dataclasses.replace(
                state,
                step=state.step + 1,
                model=eqx.apply_updates(state.model, updates),
                opt_state=opt_state,
                key=next_key,
                model_state=model_state,
                loss_scale=loss_scale,
            )
            if parts.ema is not None:
                new = new.averaged(parts.ema)
            return layout.flatten(new)

        def kept(loss_scale: DynamicScale | None) -> list[jax.Array]:
            return layout.flatten(dataclasses.replace(state, loss_scale=loss_scale))

        update = Update(state.step, leaves, grads, state.loss_scale, apply, kept)
        leaves, epoch_sums, sums = _guard(
            parts.nan_policy, update, sums, epoch_sums, total
        )
        return leaves, epoch_sums, sums, grads

    def train_step(leaves, epoch_sums, batch_leaves, weight, total):
        return step(leaves, epoch_sums, batch_leaves, weight, total)[:3]

    def inspect_step(leaves, epoch_sums, batch_leaves, weight, total):
        leaves, _, sums, grads = step(leaves, epoch_sums, batch_leaves, weight, total)
        return leaves, grads, sums

    def eval_step(leaves, epoch_sums, batch_leaves, weight):
        state = unflatten(leaves)
        model = eqx.nn.inference_mode(state.averaged_model)
        params, arrays, static = _split_model(model)

        def local(replicated, model_state, examples):
            params, rest = replicated
            sums = run(static, params, rest, model_state, examples, True)[0]
            return _packed(sums), model_state

        sums, _ = strategy.reduce(
            local,
            (params, (arrays, state.key)),
            state.model_state,
            examples(batch_leaves, weight),
        )
        return epoch_sums + sums

    def probe(leaves, batch_leaves, weight, inference=False):
        state = unflatten(leaves)
        model = (
            eqx.nn.inference_mode(state.averaged_model) if inference else state.model
        )
        params, arrays, static = _split_model(model)

        def local(replicated, examples):
            params, rest, model_state = replicated
            sums, outputs, _ = run(
                static, params, rest, model_state, examples, inference
            )
            return outputs, jax.tree.map(lambda s: s[None], sums)

        replicated = (params, (arrays, state.key), state.model_state)
        return strategy.map(local, replicated, examples(batch_leaves, weight))

    return StepFunctions(train_step, eval_step, probe, inspect_step)


def several_steps(train_step: Callable) -> Callable:
    """`train_step` over a leading steps axis of its batch leaves, weights
    and totals: several steps in one compiled call (`jax.lax.scan`), the
    state and the epoch's sums carried from step to step, each step's sums
    stacked (a row each)."""

    def train_steps(leaves, epoch_sums, batch_leaves, weight, total):
        def step(carry, batch):
            leaves, epoch_sums, sums = train_step(*carry, *batch)
            return (leaves, epoch_sums), sums

        (leaves, epoch_sums), sums = jax.lax.scan(
            step, (leaves, epoch_sums), (batch_leaves, weight, total)
        )
        return leaves, epoch_sums, sums

    return train_steps


class Update(NamedTuple):
    """A train step's update, before `_guard` decides whether it happens.

    Attributes:
        step: the state's step before it.
        leaves: the state's arrays before it.
        grads: the gradient it applies (checked for non-finite values).
        loss_scale: the dynamic loss scale it used (None: no dynamic scale).
        apply: the updated state's arrays, given the loss scale to keep.
        keep: the old state's arrays, given the loss scale to keep.
    """

    step: jax.Array
    leaves: list[jax.Array]
    grads: Any
    loss_scale: DynamicScale | None
    apply: Callable[[DynamicScale | None], list[jax.Array]]
    keep: Callable[[DynamicScale | None], list[jax.Array]]


def _guard(
    policy: str,
    update: Update,
    sums: jax.Array,
    epoch_sums: EpochSums,
    total: jax.Array,
) -> tuple[list[jax.Array], EpochSums, jax.Array]:
    """Apply the non-finite gradient policy and the dynamic loss scale to an
    `update`; add the step's `sums` to the epoch's.

    Returns the new state's leaves, the epoch's sums, and the step's packed
    sums (then 1 if the step was skipped, under ``"skip"`` or a dynamic
    loss scale; then the loss scale the step used, under a dynamic one).

    ``"raise"`` freezes the state at the first bad step and records it (with
    its first non-finite leaf, or `ZERO_WEIGHT` where the batch's `total`
    weight was 0), so the host can raise at its next sync point with the
    state from before that step; ``"skip"`` keeps the old state and counts
    the step; ``"off"`` always applies the update. Under a dynamic loss
    scale, a non-finite gradient while the scale is above its floor is not
    the policy's: the step is skipped (and counted) and the scale halves.

    The update runs in a `lax.cond`, so that a good step updates the state
    in place instead of selecting between two copies of it.
    """
    loss_scale = update.loss_scale
    finite_leaves = _finite_leaves(update.grads)
    finite = jnp.all(finite_leaves)
    skipped, bad_step, bad_leaf = epoch_sums.flags
    halted = bad_step >= 0
    overflow = jnp.bool_(False)
    if loss_scale is not None:
        overflow = ~finite & (loss_scale.scale > DynamicScale.MIN)
    apply = {"off": ~overflow, "skip": finite, "raise": finite & ~halted}[policy]
    first_bad = ~finite & ~overflow & ~halted if policy == "raise" else jnp.bool_(False)
    if loss_scale is None:
        if policy == "off":
            leaves = update.apply(None)
        else:
            leaves = jax.lax.cond(
                apply, lambda: update.apply(None), lambda: update.leaves
            )
    else:
        # Frozen where "raise" froze the state; else it moves with the step.
        moved = loss_scale.next(finite)
        scale_after = jax.tree.map(
            lambda a, b: jnp.where(halted | first_bad, a, b), loss_scale, moved
        )
        leaves = jax.lax.cond(
            apply, lambda: update.apply(scale_after), lambda: update.keep(scale_after)
        )
    flags = [
        skipped + (~apply).astype(jnp.int32),
        jnp.where(first_bad, update.step, bad_step),
        jnp.where(first_bad, _bad_leaf(finite_leaves, total), bad_leaf),
    ]
    epoch_sums = EpochSums(
        epoch_sums.sums + jnp.where(apply, sums, 0), jnp.stack(flags)
    )
    if policy == "skip" or loss_scale is not None:
        sums = jnp.append(sums, (~apply).astype(sums.dtype))
    if loss_scale is not None:
        sums = jnp.append(sums, loss_scale.scale.astype(sums.dtype))
    return leaves, epoch_sums, sums


def _loss_scale(precision: Precision, dynamic: DynamicScale | None) -> jax.Array | None:
    """The factor a step multiplies the loss by (None: no scaling)."""
    if precision.loss_scale is None:
        return None
    if precision.loss_scale == "dynamic":
        assert dynamic is not None, "a dynamic loss scale lives in the state"
        return dynamic.scale
    return jnp.asarray(precision.loss_scale, jnp.float32)


def _bad_leaf(finite_leaves: jax.Array, total: jax.Array) -> jax.Array:
    """The first non-finite leaf, or `ZERO_WEIGHT` for a batch weighing 0 (its
    gradient is 0 / 0: the batch, not the model, is at fault)."""
    first = jnp.argmin(finite_leaves).astype(jnp.int32)
    return jnp.where(total > 0, first, jnp.int32(ZERO_WEIGHT))


def _finite_leaves(grads: Any) -> jax.Array:
    """Whether each leaf of `grads` is finite everywhere, as a bool vector.

    A sum is finite only if every term is (a NaN or ±inf survives any order
    of additions), so one sum of the leaves' sums settles the usual case in
    a single read of the gradient. A non-finite total can also be finite
    values overflowing: only then, or for a bad step, is each leaf checked
    exactly, with x - x (0 for a finite x, NaN otherwise; it cannot
    overflow, and x * 0 would multiply by a broadcast zeros array, which XLA
    may share with an accumulator's zeros and then copy).
    """
    leaves = jax.tree.leaves(grads)
    # Low-precision leaves are summed in float32, where their sums stay far
    # from overflow (float16's largest value is 65504).
    total = sum(
        jnp.sum(g, dtype=jnp.promote_types(g.dtype, jnp.float32)) for g in leaves
    )

    def each() -> jax.Array:
        return ~jnp.isnan(jnp.stack([jnp.sum(g - g) for g in leaves]))

    every = jnp.ones(len(leaves), jnp.bool_)
    return jax.lax.cond(jnp.isfinite(total), lambda: every, each)


def build_predict_step(
    parts: StepParts, layout: StateLayout, inputs_treedef: Any
) -> Callable:
    """A predict step: per-example outputs of the model in inference mode,
    called as `inference_model` says and without randomness, computed in the
    precision policy's dtypes."""
    precision = parts.precision

    def predict_step(leaves, input_leaves):
        state = layout.unflatten(leaves)
        model = eqx.nn.inference_mode(state.averaged_model)
        arrays, static = eqx.partition(model, eqx.is_array)
        inputs = jax.tree.unflatten(inputs_treedef, input_leaves)

        def local(replicated, inputs):
            arrays, model_state = replicated
            compute = precision.compute  # as the train step runs the model
            outputs = infer(
                inference_call(
                    parts, eqx.combine(precision.cast(arrays, compute), static)
                ),
                precision.cast(inputs, compute),
                state=precision.cast(model_state, compute),
            )[0]
            return precision.cast(outputs, precision.output)

        return parts.strategy.map(local, (arrays, state.model_state), inputs)

    return predict_step
