"""`assert_equivalent`: your trainer under each strategy against one device
on the full batch, step by step from the same state."""

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import equinox as eqx
import jax

from .._engine.program._programs import StepValues
from .._state._train_state import TrainState
from .._trainer import DataParallelTrainer
from .._typing import validates_own_arguments
from .._validate import finite_at_least, positive_int
from ..strategies import PmapStrategy, ShardingStrategy, Strategy
from ._compare import (
    HINT,
    check_step,
    check_update,
    gaps,
    named_leaves,
    zero_levels,
)
from ._optimizer import update_allowances
from ._report import Equivalence
from ._setups import replayable, setups, split_leaves


MakeTrainer = Callable[[Strategy], DataParallelTrainer[Any]]


@validates_own_arguments
def assert_equivalent(
    make_trainer: MakeTrainer,
    batches: Iterable[Any],
    *,
    strategies: Sequence[Strategy | tuple[str, Strategy]] | None = None,
    steps: int = 10,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> dict[str, Equivalence]:
    """Check that your trainer computes what one device computes on the full
    batch, under every strategy.

    phalanx's own strategies are exact for any loss that returns one value per
    example; this checks *your* trainer (your subclass, loss, metrics,
    collectives, model and optimizer). It builds it once per set-up and
    compares each of `steps` training steps with the reference's, one device
    holding the whole batch (`ShardingStrategy` on ``jax.devices()[:1]``;
    `PmapStrategy` on that device where the loss needs a device axis, e.g.
    for a collective). Each set-up takes every step from the reference's state
    before it (`DataParallelTrainer.compute_step`), so that each step is
    judged on what a strategy is responsible for, not on how rounding grows
    over a run:

    1. The reduced gradient, the loss, the metrics and the new model state
       must match the reference's to `rtol` of their scale (a leaf's largest
       magnitude, or a tenth of the largest leaf's where that is more:
       rounding elsewhere reaches a leaf that small).
    2. The parameters the step leads to, a second signal, must match to
       `atol` plus what the optimizer makes of the rounding in the gradient.
       An optimizer that normalises the gradient (adam) turns an entry that
       is zero up to rounding (a key bias under softmax, a bias before
       BatchNorm) into a step of the learning rate's size in whichever
       direction the rounding points; such leaves are allowed for and named
       in the result's ``amplified``, not blamed on the strategy.

    Call it in a test: it raises `AssertionError` on the first difference and
    returns what it measured otherwise.

    Args:
        make_trainer: ``make_trainer(strategy) -> DataParallelTrainer``, a new
            trainer built with ``strategy=strategy`` and the same model every
            time (build it with ``progress=False``). Its steps are taken
            without `fit`: callbacks do not run.
        batches: the training batches, as for `DataParallelTrainer.fit`. They
            are read once and replayed to every set-up, in order, re-iterated
            until `steps` steps are taken. Use a batch size that is a multiple of
            the local device count × 2, so that no set-up pads a batch.
        strategies: the set-ups to compare with the reference: strategies, or
            ``(name, strategy)`` pairs. Default, on all devices:
            `ShardingStrategy()`, `PmapStrategy()`,
            ``AccumulatingStrategy(ShardingStrategy(), 2)``, a
            `FullyShardedStrategy` whose ``min_size`` is chosen from your model
            so that it splits the larger half of the leaves it can split (the
            default 4096 would split none of a test-sized model; the result's
            ``split`` names them) and, on an even count of 4 devices or more,
            hybrid sharding: ``MeshStrategy(data=2, fsdp=n // 2)`` splitting
            the same way. Tensor parallelism needs your model's rules: pass
            ``MeshStrategy(..., tensor=2, rules=...)`` here to check them.
            Pass per-device strategies only for a loss with collectives.
        steps: training steps to compare.
        rtol: the largest difference allowed in a step's gradient, loss,
            metrics and model state, relative to their scale.
        atol: the largest absolute difference allowed in a parameter after a
            step, on top of what the optimizer makes of rounding.

    Returns:
        ``{set-up name: Equivalence}``: the largest differences found (see
        [`Equivalence`][phalanx.testing.Equivalence]).

    Raises:
        AssertionError: a set-up differs from the reference, or cannot train:
            the message names the set-up, the step, the value (the loss, a
            metric, or the gradient, model state or parameter of a leaf by
            its path), the difference, and the usual causes.
        TypeError, ValueError: a bad argument, or `make_trainer` returned no
            new trainer built with the strategy it was given, or another model.

    Example:
        A contrastive loss whose negatives come from every device, with a
        classic bug: each device labels its positives ``0, 1, 2, ...`` as if
        it held the whole batch, forgetting its offset in the gathered
        embeddings (add ``jax.lax.axis_index(axis) * outputs.shape[0]``). On
        one device it is right; on eight it is caught:

        <!-- raises: AssertionError -->
        ```python
        x = np.random.default_rng(0).normal(size=(64, 16)).astype(np.float32)

        class Contrastive(px.DataParallelTrainer):
            @override
            def loss(self, model, outputs, targets):
                del model, targets
                axis = self.strategy.axis_name
                everyone = jax.lax.all_gather(outputs, axis, tiled=True)
                own = jnp.arange(outputs.shape[0])  # the bug: no offset
                return optax.softmax_cross_entropy_with_integer_labels(
                    outputs @ everyone.T, own
                )

        def make_trainer(strategy):
            embed = px.models.MLP(16, 8, hidden=(32,), key=jax.random.key(2))
            return Contrastive(embed, optax.sgd(0.1), strategy=strategy,
                               loss=lambda outputs, targets: outputs[:, 0],
                               progress=False)

        px.testing.assert_equivalent(
            make_trainer, [(x, np.zeros(64, np.float32))],
            strategies=[px.PmapStrategy(), px.FullyShardedStrategy()], steps=3,
        )
        # AssertionError: PmapStrategy on 8 devices: at step 0, from the same
        # state as one device on the full batch, the loss is 4.11097 where one
        # device computes 3.7882 (difference 0.323, ...). The usual causes: ...
        ```

        The guide runs it in full: [Check your own
        trainer](../guides/strategies.md#check-your-own-trainer).
    """
    if not callable(make_trainer):
        raise TypeError(
            f"make_trainer={make_trainer!r} is not callable; pass a function "
            "strategy -> DataParallelTrainer, e.g. lambda strategy: "
            "px.DataParallelTrainer(model, optimizer, strategy=strategy)"
        )
    positive_int("steps", steps, example="10")
    finite_at_least("rtol", rtol, 0.0, example="1e-4")
    finite_at_least("atol", atol, 0.0, example="1e-5")
    data = replayable(batches)
    reference = _reference(make_trainer, data[0])
    initial = reference.state
    params = jax.tree.leaves(eqx.filter(initial.model, eqx.is_inexact_array))
    trainers = {}
    for name, strategy in setups(strategies, params):
        trainers[name] = _build(make_trainer, strategy)
        _check_start(name, initial, trainers[name])

    worst = {name: [0.0, 0.0, 0.0, 0.0] for name in trainers}
    amplified: dict[str, set[str]] = {name: set() for name in trainers}
    allowances = update_allowances(reference.optimizer)
    for step in range(steps):
        batch = data[step % len(data)]
        state = reference.state
        want = reference.compute_step(batch)
        zero = zero_levels(want.grads, rtol)
        expected = named_leaves(want.state.model)
        for name, trainer in trainers.items():
            # What the strategy computes from the reference's state: the
            # step's gradient, loss, metrics and model state...
            have = _attempt(name, _step_from, trainer, state, batch)
            found = check_step(name, step, want, have, rtol)
            # ... and the parameters it leads to.
            allowed = allowances(state, want.grads, have.grads, zero)
            update, beyond = check_update(
                name,
                step,
                atol,
                gaps(expected, named_leaves(have.state.model)),
                allowed,
            )
            amplified[name].update(beyond)
            worst[name] = [
                max(a, b) for a, b in zip(worst[name], (*found, update), strict=True)
            ]
        reference.state = want.state
    return {
        name: Equivalence(
            *worst[name],
            split=split_leaves(_model_leaves(trainer)),
            amplified=tuple(sorted(amplified[name])),
        )
        for name, trainer in trainers.items()
    }


def _reference(make_trainer: MakeTrainer, batch: Any) -> DataParallelTrainer[Any]:
    """The reference trainer: one device holding the whole batch, under
    `ShardingStrategy`, or `PmapStrategy` where the loss needs a device axis
    (a collective): one device of a per-device program is the same
    computation on the full batch."""
    device = jax.devices()[:1]
    trainer = _build(make_trainer, ShardingStrategy(device))
    try:
        trainer.compute_step(batch)
        return trainer
    except (TypeError, ValueError):
        raise
    except Exception as error:
        trainer = _build(make_trainer, PmapStrategy(device))
        try:
            trainer.compute_step(batch)
        except Exception as second:
            raise AssertionError(
                "the reference, one device on the full batch, could not run a "
                f"step: under ShardingStrategy: {type(error).__name__}: {error}"
                f"\nunder PmapStrategy: {type(second).__name__}: {second}"
            ) from second
        return trainer


def _build(make_trainer: MakeTrainer, strategy: Strategy) -> DataParallelTrainer[Any]:
    """A new trainer from `make_trainer`, checked to use `strategy`."""
    trainer = make_trainer(strategy)
    if not isinstance(trainer, DataParallelTrainer):
        raise TypeError(
            f"make_trainer returned {type(trainer).__name__}, not a DataParallelTrainer"
        )
    if trainer.strategy is not strategy:
        raise ValueError(
            "make_trainer ignored its strategy: build the trainer with "
            "strategy=strategy"
        )
    if trainer.progress.step != 0:
        raise ValueError(
            f"make_trainer returned a trainer at step {trainer.progress.step}; "
            "build a new one on every call"
        )
    return trainer


def _check_start(
    name: str, initial: TrainState, trainer: DataParallelTrainer[Any]
) -> None:
    """The set-up's trainer starts where the reference does."""
    want = named_leaves(initial.model)
    for path, diff, _ in gaps(want, named_leaves(trainer.state.model)):
        if diff != 0:
            raise ValueError(
                f"{name}: make_trainer built a model whose parameter {path} "
                f"differs from the reference's by {diff:.3g} before any step; "
                "build the same model on every call (e.g. from a fixed key)"
            )


def _step_from(
    trainer: DataParallelTrainer[Any], state: TrainState, batch: Any
) -> StepValues:
    """What `trainer` computes on `batch` from `state`."""
    trainer.state = state
    return trainer.compute_step(batch)


def _attempt(name: str, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`run(*args, **kwargs)`; a failure not of the arguments is the set-up's."""
    try:
        return run(*args, **kwargs)
    except (TypeError, ValueError):
        raise
    except Exception as error:
        raise AssertionError(
            f"{name} could not train: {type(error).__name__}: {error}\n{HINT}"
        ) from error


def _model_leaves(trainer: DataParallelTrainer[Any]) -> list[tuple[str, jax.Array]]:
    """The model's floating-point leaves, on their devices, by path."""
    arrays = eqx.filter(trainer.state.model, eqx.is_inexact_array)
    return [
        (jax.tree_util.keystr(path).removeprefix("."), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]
    ]
