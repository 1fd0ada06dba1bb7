"""A trainer put together: its settings and hooks made into the parts a run
needs (`assemble` -> `TrainerParts`), once, in the constructor; and the
small readings of those parts the trainer's methods share.

Nothing here keeps a reference to the trainer: the hooks arrive as bound
methods (`TrainerHooks`), the settings as values.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

from .._engine.feed._pipeline import BatchPipeline, HostHooks
from .._engine.program._program import ProgramParts
from .._engine.program._programs import Programs
from .._engine.step._forward import takes_key
from .._engine.step._groups import group_labels, grouped
from .._engine.step._layout import StateLayout, state_layout
from .._engine.step._step import StepParts
from .._precision import Precision
from .._state._builder import StateBuilder
from .._state._learning_rate import next_rate
from .._state._progress import RunProgress
from .._state._run import Run, RunSlot
from .._state._train_state import DynamicScale, TrainState
from .._typing import HostMetrics, LossName, NanPolicy
from ..callbacks import ProgressBar
from ..callbacks._base import Callback, StepInfo, TrainerLike
from ..callbacks._dispatch import Callbacks
from ..checkpoint._settings import run_settings
from ..strategies import Strategy
from ..strategies._placement import put_state
from ._current import CurrentFit


@runtime_checkable
class TrainerSettings(Protocol):
    """The settings of a trainer the assembly reads (`DataParallelTrainer`'s
    attributes, set before its parts are put together)."""

    strategy: Strategy
    precision: Precision
    nan_policy: NanPolicy
    steps_per_call: int
    ema: float | None


class TrainerHooks(NamedTuple):
    """A trainer's hooks (its bound methods; `eval_metrics` None where the
    trainer keeps the default, evaluations then computing `metrics`)."""

    split_batch: Callable[[Any], Any]
    sample_weight: Callable[[Any], Any]
    loss: Callable[..., Any]
    metrics: Callable[..., Any]
    eval_metrics: Callable[..., Any] | None
    gradients: Callable[..., Any]
    inference_model: Callable[..., Any]
    param_groups: Callable[[Any], Any]

    @classmethod
    def of(cls, trainer: Any, own_eval_metrics: bool) -> "TrainerHooks":
        """The hooks of `trainer` (a `DataParallelTrainer`), its
        `eval_metrics` only where its class overrides it."""
        return cls(
            trainer.split_batch,
            trainer.sample_weight,
            trainer.loss,
            trainer.metrics,
            trainer.eval_metrics if own_eval_metrics else None,
            trainer.gradients,
            trainer.inference_model,
            trainer.param_groups,
        )


class TrainerParts(NamedTuple):
    """What a trainer is made of, besides its public settings.

    Attributes:
        optimizer: the optax transformation the step applies (a mapping of
            groups' as one `optax.multi_transform`).
        settings: the settings that shape every update (a resume must have
            these).
        layout: how the state travels (structure, shardings).
        slot: the run (state and progress): its one home.
        builder: builds `TrainState`s from the run's arrays.
        copy: copies the state's arrays before a loop donates them, so
            states handed out stay valid.
        strategy: how the state and batches are laid out.
        pipeline: host batches to device batches.
        programs: the programs built so far (and what builds the next).
        current: the fit running now (see `CurrentFit`).
        step_names: a step's metric names where known up front (None: an
            overriding `metrics` hook's, known once a batch is traced).
        eval_names: the same of an evaluation's.
    """

    optimizer: optax.GradientTransformation
    settings: dict[str, Any]
    layout: StateLayout
    slot: RunSlot
    builder: StateBuilder
    copy: Callable[[list[jax.Array]], list[jax.Array]]
    strategy: Strategy
    pipeline: BatchPipeline
    programs: Programs
    current: CurrentFit
    step_names: tuple[str, ...] | None
    eval_names: tuple[str, ...] | None


def assemble(
    model: eqx.Module,
    optimizer: optax.GradientTransformation
    | Mapping[str, optax.GradientTransformation],
    hooks: TrainerHooks,
    trainer: TrainerSettings,
    *,
    seed: int,
    model_state: eqx.nn.State | None,
    checks: str,
    loss_name: LossName | None,
    class_labels: bool,
    step_names: tuple[str, ...] | None,
) -> TrainerParts:
    """The parts of a trainer of `model` (its floating arrays already in the
    precision's parameter dtype) and `optimizer`, its state placed as the
    strategy lays it out.

    Args:
        hooks: the trainer's hooks.
        trainer: the trainer's settings (`strategy`, `precision`,
            `nan_policy`, `steps_per_call`, `ema`), as it declares them.
        class_labels: check class labels where the built-in loss or
            metrics read them.
        step_names: a step's metric names where known up front.
        (The rest: the trainer's arguments.)

    Raises:
        ValueError: `optimizer` is a mapping of groups and the trainer's
            `param_groups` says none.
    """
    strategy, precision, ema = trainer.strategy, trainer.precision, trainer.ema
    groups = None
    if isinstance(optimizer, Mapping):
        labels = hooks.param_groups(model)
        if labels is None:
            raise ValueError(
                f"optimizer is a mapping of parameter groups {list(optimizer)}; "
                "override param_groups(self, model) to say which parameters "
                "each trains, e.g. return eqx.tree_at(lambda m: (m.generator, "
                "m.discriminator), model, ('generator', 'discriminator'))"
            )
        groups = grouped(optimizer, labels, model)
        optimizer = groups.optimizer
    floating = eqx.filter(model, eqx.is_inexact_array)
    state = TrainState(
        step=jnp.asarray(0, jnp.int32),
        model=model,
        opt_state=optimizer.init(floating),
        key=jr.key(seed),
        model_state=model_state,
        loss_scale=DynamicScale.initial()
        if precision.loss_scale == "dynamic"
        else None,
        # A copy: the state's leaves are donated, each buffer once.
        ema=None if ema is None else jax.tree.map(jnp.copy, floating),
    )
    settings = run_settings(
        ema=ema,
        precision=precision.describe(),
        loss=loss_name,
        groups=None if groups is None else group_labels(groups),
        learning_rate=next_rate(optimizer, state.opt_state).value,
    )
    layout = state_layout(strategy, state)
    shardings = layout.shardings
    slot = RunSlot(Run(put_state(layout.flatten(state), shardings), RunProgress()))
    parts = StepParts(
        loss=hooks.loss,
        metrics=hooks.metrics,
        gradients=hooks.gradients,
        optimizer=optimizer,
        strategy=strategy,
        nan_policy=trainer.nan_policy,
        pass_key=takes_key(model),
        precision=precision,
        inference_model=hooks.inference_model,
        eval_metrics=hooks.eval_metrics,
        ema=ema,
        groups=groups,
    )
    programs = Programs(
        ProgramParts(
            parts,
            layout,
            traced_checks=checks == "on",
            steps_per_call=trainer.steps_per_call,
        )
    )
    pipeline = BatchPipeline(
        strategy,
        HostHooks(hooks.split_batch, hooks.sample_weight),
        programs,
        value_checks=checks == "on",
        class_labels=class_labels,
    )
    return TrainerParts(
        optimizer=optimizer,
        settings=settings,
        layout=layout,
        slot=slot,
        builder=StateBuilder(layout.unflatten(slot.run.leaves), layout.keys),
        # (device_put to a replicated sharding may share the user's own
        # buffer, and donating the result would delete it.)
        copy=jax.jit(lambda xs: [jnp.copy(x) for x in xs], out_shardings=shardings),
        strategy=strategy,
        pipeline=pipeline,
        programs=programs,
        current=CurrentFit(),
        step_names=step_names,
        eval_names=step_names if hooks.eval_metrics is None else None,
    )


def dispatch(callbacks: Sequence[Callback], show_progress: bool) -> Callbacks:
    """The calls into `callbacks`, with the default progress bar where the
    trainer shows one and they hold none."""
    shown = show_progress and not any(isinstance(c, ProgressBar) for c in callbacks)
    return Callbacks(callbacks, ProgressBar(plain_steps=False) if shown else None)


def metric_names(parts: TrainerParts) -> tuple[tuple[str, ...] | None, ...]:
    """A step's and an evaluation's metric names, ``loss`` first: from the
    program once a batch has been traced, else where known up front (None
    until then)."""
    program = parts.programs.first
    if program is not None:
        return program.sums.metric_names, program.eval_sums.metric_names
    return parts.step_names, parts.eval_names


def epoch_extras(precision: Precision, nan_policy: NanPolicy) -> tuple[str, ...]:
    """What the loop adds to every epoch's metrics."""
    dynamic = precision.loss_scale == "dynamic"
    skipped = ("skipped_steps",) if nan_policy == "skip" or dynamic else ()
    return (*skipped, "loss_scale") if dynamic else skipped


def checked_leaves(layout: StateLayout, state: TrainState) -> list[Any]:
    """The arrays of `state`, which must be of the layout's structure."""
    treedef = jax.tree.structure(eqx.filter(state, eqx.is_array))
    if treedef != layout.treedef:
        raise ValueError(
            f"state has structure {treedef}, which differs from the trainer's "
            f"{layout.treedef}; pass a TrainState of this trainer's model "
            "and optimizer (e.g. one returned by fit)"
        )
    leaves = layout.flatten(state)
    for new, old in zip(leaves, layout.structs, strict=True):
        if new.shape != old.shape or new.dtype != old.dtype:
            raise ValueError(
                f"state has a leaf {new.dtype}{list(new.shape)} where the trainer "
                f"has {old.dtype}{list(old.shape)}; pass a TrainState of this "
                "trainer's model and optimizer"
            )
    return leaves


def info_now(
    trainer: TrainerLike, parts: TrainerParts, metrics: HostMetrics | None = None
) -> StepInfo:
    """What a callback is told outside the loop's steps: the running fit's
    view, or the run's between fits (see `CurrentFit.info`)."""
    return parts.current.info(trainer, parts.slot.progress, metrics)
