from collections.abc import Callable, Iterable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._summary import strategy_name
from .._trainer import DataParallelTrainer
from .._typing import validates_own_arguments
from .._validate import positive_int
from ..strategies import (
    AccumulatingStrategy,
    FullyShardedStrategy,
    PmapStrategy,
    ShardingStrategy,
    Strategy,
)


MakeTrainer = Callable[[Strategy], DataParallelTrainer[Any]]

_HINT = """\
The usual causes:
- a loss averaged per device instead of per example: return one value per
  example (a mean over the batch, or a division by the local batch size, is a
  mean of means across devices); phalanx weights and averages them once;
- a collective (psum, pmean, all_gather) in the loss under ShardingStrategy,
  where no device axis is bound: collectives need a per-device strategy
  (PmapStrategy, FullyShardedStrategy), so pass strategies= without it;
- a collective where none belongs (psum of the per-example losses: phalanx
  already sums over the devices once) or over the wrong axis: use
  self.strategy.axis_name;
- a loss that depends on the per-device batch size (x.shape[0], a mean over
  the local batch inside a per-example value);
- BatchNorm statistics per device (axis_name="batch" under a per-device
  strategy): use axis_name=("batch", strategy.axis_name) for global ones;
- a batch not divisible by a set-up's devices x microbatches: the trainer pads
  it with zero-weight rows, which collectives and batch statistics see."""


@validates_own_arguments
def assert_equivalent(
    make_trainer: MakeTrainer,
    batches: Iterable[Any],
    *,
    strategies: Sequence[Strategy | tuple[str, Strategy]] | None = None,
    steps: int = 10,
    atol: float = 1e-5,
) -> dict[str, float]:
    """Check that your trainer makes the update of one device on the full batch
    under every strategy.

    phalanx's own strategies are exact for any loss that returns one value per
    example; this checks *your* trainer (your subclass, loss, metrics,
    collectives, model and optimizer): it builds it once per set-up, trains
    each `steps` steps on the same batches, and compares every parameter leaf
    and the logged loss with the reference, one device holding the whole batch
    (`ShardingStrategy` on ``jax.devices()[:1]``; `PmapStrategy` on that device
    where the loss needs a device axis, e.g. for a collective). Call it in a
    test: it raises `AssertionError` on the first difference and returns the
    differences otherwise.

    Args:
        make_trainer: ``make_trainer(strategy) -> DataParallelTrainer``, a new
            trainer built with ``strategy=strategy`` (build it with
            ``progress=False`` to keep the output quiet; its callbacks run).
        batches: the training batches, as for `DataParallelTrainer.fit`. They
            are read once and replayed to every set-up, re-iterated until
            `steps` updates are made. Use a batch size that is a multiple of
            the local device count × 2, so that no set-up pads a batch.
        strategies: the set-ups to compare with the reference: strategies, or
            ``(name, strategy)`` pairs. Default: `ShardingStrategy()`,
            `PmapStrategy()`, ``AccumulatingStrategy(ShardingStrategy(), 2)``
            and `FullyShardedStrategy()`, each on all local devices. Pass
            per-device strategies only for a loss with collectives.
        steps: optimizer updates per set-up.
        atol: the largest absolute difference allowed in a parameter (and in
            the logged loss, relative to its size where that exceeds 1).

    Returns:
        ``{set-up name: max |difference| over the parameters}``.

    Raises:
        AssertionError: a set-up's parameters or logged loss differ from the
            reference's by more than `atol`, or a set-up cannot train: the
            message names the set-up, the first differing parameter leaf by
            its path, the difference, the step count, and the usual causes.
        TypeError, ValueError: a bad argument, or `make_trainer` returned no
            new trainer built with the strategy it was given.

    Example:
        A contrastive loss whose negatives come from every device, with a
        classic bug: each device labels its positives ``0, 1, 2, ...`` as if
        it held the whole batch, forgetting its offset in the gathered
        embeddings (add ``jax.lax.axis_index(axis) * outputs.shape[0]``). On
        one device it is right; on eight it is caught:

        ```python
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
        # AssertionError: PmapStrategy on 8 devices: parameter layers[0].weight
        # differs from one device on the full batch by 0.0293 (max abs;
        # atol=1e-05) after 3 steps. The usual causes: ...
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
    if not isinstance(atol, int | float) or not atol >= 0:
        raise ValueError(f"atol={atol!r} must be a non-negative number, e.g. 1e-5")
    data = _replayable(batches)
    setups = _setups(strategies)
    reference, ref_loss = _reference(make_trainer, data, steps)
    differences = {}
    for name, strategy in setups:
        try:
            trainer = _train(make_trainer, strategy, data, steps)
        except (TypeError, ValueError):
            raise
        except Exception as error:
            raise AssertionError(
                f"{name} could not train {steps} steps: {type(error).__name__}: "
                f"{error}\n{_HINT}"
            ) from error
        differences[name] = _compare(name, steps, atol, reference, ref_loss, trainer)
    return differences


def _replayable(batches: object) -> list[Any]:
    # Read once: a shuffling loader re-iterated per set-up could feed each a
    # different order.
    if not isinstance(batches, Iterable) or isinstance(batches, str | bytes):
        raise TypeError(
            f"batches={type(batches).__name__} is not an iterable of batches; "
            "pass e.g. [(x, y)]"
        )
    data = list(batches)
    if not data:
        raise ValueError("batches is empty; pass at least one batch, e.g. [(x, y)]")
    return data


def _setups(strategies: object) -> list[tuple[str, Strategy]]:
    # `object`: checked here, with messages that name the fix.
    if strategies is None:
        n = len(jax.local_devices())
        return [
            (f"ShardingStrategy on {n} devices", ShardingStrategy()),
            (f"PmapStrategy on {n} devices", PmapStrategy()),
            (
                f"AccumulatingStrategy(ShardingStrategy(), 2) on {n} devices",
                AccumulatingStrategy(ShardingStrategy(), 2),
            ),
            (f"FullyShardedStrategy on {n} devices", FullyShardedStrategy()),
        ]
    if isinstance(strategies, Strategy) or not isinstance(strategies, Sequence):
        raise TypeError(
            f"strategies={strategies!r} must be a list of strategies or of "
            "(name, strategy) pairs, e.g. [px.PmapStrategy()]"
        )
    setups = []
    for item in strategies:
        if isinstance(item, Strategy):
            name = f"{strategy_name(item)} on {item.num_devices} devices"
            if any(name == seen for seen, _ in setups):
                name = f"{name} (#{len(setups) + 1})"
            setups.append((name, item))
        elif (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], Strategy)
        ):
            setups.append(item)
        else:
            raise TypeError(
                f"strategies: {item!r} is neither a strategy nor a (name, "
                "strategy) pair"
            )
    if not setups:
        raise ValueError("strategies is empty; pass at least one, or None")
    return setups


def _train(
    make_trainer: MakeTrainer, strategy: Strategy, data: list[Any], steps: int
) -> DataParallelTrainer[Any]:
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
    trainer.fit(data, steps=steps)
    return trainer


def _reference(
    make_trainer: MakeTrainer, data: list[Any], steps: int
) -> tuple[DataParallelTrainer[Any], list[float]]:
    device = jax.devices()[:1]
    try:
        trainer = _train(make_trainer, ShardingStrategy(device), data, steps)
    except (TypeError, ValueError):
        raise
    except Exception as error:
        # A loss with collectives needs a bound device axis: one device of a
        # per-device program is the same computation on the full batch.
        try:
            trainer = _train(make_trainer, PmapStrategy(device), data, steps)
        except Exception as second:
            raise AssertionError(
                f"the reference, one device on the full batch, could not train "
                f"{steps} steps: under ShardingStrategy: {type(error).__name__}: "
                f"{error}\nunder PmapStrategy: {type(second).__name__}: {second}"
            ) from second
    return trainer, _losses(trainer)


def _losses(trainer: DataParallelTrainer[Any]) -> list[float]:
    return list(trainer.history["loss"]) if len(trainer.history) else []


def _leaves(trainer: DataParallelTrainer[Any]) -> list[tuple[str, np.ndarray]]:
    state = trainer.state
    trees = {"": state.model, "model_state": state.model_state}
    leaves = []
    for prefix, tree in trees.items():
        if tree is None:
            continue
        arrays = eqx.filter(tree, eqx.is_inexact_array)
        for path, leaf in jax.tree_util.tree_flatten_with_path(arrays)[0]:
            name = (prefix + jax.tree_util.keystr(path)).removeprefix(".")
            leaves.append((name, np.asarray(jax.device_get(leaf))))
    return leaves


def _compare(
    name: str,
    steps: int,
    atol: float,
    reference: DataParallelTrainer[Any],
    ref_loss: list[float],
    trainer: DataParallelTrainer[Any],
) -> float:
    worst = 0.0
    expected = _leaves(reference)
    got = _leaves(trainer)
    if [path for path, _ in expected] != [path for path, _ in got]:
        raise ValueError(
            f"{name}: make_trainer built a model of another structure than the "
            "reference's; build the same model on every call"
        )
    for (path, want), (_, have) in zip(expected, got, strict=True):
        diff = float(np.max(np.abs(want - have), initial=0.0))
        if not diff <= atol:  # NaN fails too
            raise AssertionError(
                f"{name}: parameter {path} differs from one device on the full "
                f"batch by {diff:.3g} (max abs; atol={atol:g}) after {steps} "
                f"steps.\n{_HINT}"
            )
        worst = max(worst, diff)
    losses = _losses(trainer)
    for epoch, (want, have) in enumerate(zip(ref_loss, losses, strict=False)):
        diff = abs(want - have)
        if not diff <= atol * max(1.0, abs(want)):
            raise AssertionError(
                f"{name}: the logged loss of epoch {epoch} is {have:.6g}, one "
                f"device on the full batch logs {want:.6g} (difference "
                f"{diff:.3g}; atol={atol:g}) after {steps} steps.\n{_HINT}"
            )
    return worst
