"""`px.plan`: the planner's entrance for a model not built yet (or too
large to build on one device): the trainer is put together on the model's
shapes alone (its constructor traced by `jax.eval_shape`: no array is made
or placed), and its `plan` (`_entry.plan_trainer`) weighs the layouts.

The one module of the planner above the trainer: it builds one, so it
imports `DataParallelTrainer`, whose `plan` reaches the rest of this room
below it; nothing that the trainer imports may import this module (the
import contracts in ``pyproject.toml`` say so)."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import optax

from .._trainer import DataParallelTrainer
from .._typing import validates_own_arguments
from ..strategies import MeshStrategy
from ._devices import DeviceSpec
from ._result import Plan
from ._space import PlanSpace


@validates_own_arguments
def plan(
    model: eqx.Module | Callable[[], eqx.Module],
    optimizer: optax.GradientTransformation,
    batch: Any,
    *,
    budget: int | str | None = None,
    space: PlanSpace | None = None,
    margin: float = 0.1,
    device: str | DeviceSpec | None = None,
    devices: int | Sequence[Any] | None = None,
    measure: int = 0,
    progress: bool | None = None,
    trainer: type[DataParallelTrainer] = DataParallelTrainer,
    **trainer_kwargs: Any,
) -> Plan:
    """Which layout to train `model` with: the fastest predicted that fits.

    Each candidate of `space` (mesh split data × fsdp × tensor, `Stacked`
    remat, microbatches) is compiled ahead of time on abstract arguments
    and costed; see `DataParallelTrainer.plan`, which this calls on a
    trainer built from the model's shapes alone.

    Args:
        model: the model, or a function of no arguments building it
            (called under `jax.eval_shape`: a model too large for one
            device is never made).
        optimizer: the optax transformation (as for the trainer).
        batch: a batch, or its shapes (`jax.ShapeDtypeStruct` leaves).
        budget: the bytes a step may take on each device: an int, or a
            string such as ``"16GiB"``; None: the device's memory where JAX
            reports it (required on CPU).
        space: what to choose among (`px.PlanSpace`); None: every mesh
            split, microbatch count and remat setting, with the rules and
            ``min_size`` of a `MeshStrategy` passed as ``strategy``; the
            microbatch counts and remat settings of any other strategy
            passed (a `ShardingStrategy`, `FullyShardedStrategy`, ...,
            planned as it is).
        margin: the share of `budget` kept free.
        device: the device the cost model prices (``"h100"``, ...; a
            `px.DeviceSpec`, e.g. ``px.calibrate()``'s); None: the devices'
            own kind, its figures measured on them once and cached on an
            accelerator (`px.calibrate`), nominal on a CPU.
        devices: how many of `jax.devices()` to plan for, or which; None:
            all.
        measure: how many of the fastest predicted that fit to run and time
            (a few steps each, on arrays of constants, with the programs the plan
            compiled): the choice is then by measured step time. 0: by
            prediction alone.
        progress: show the search's progress: True, a live bar on a
            terminal (standard error) and a log line per candidate
            elsewhere; None, the bar on a terminal and nothing elsewhere;
            False, nothing.
        trainer: the trainer class (a subclass with its own hooks).
        **trainer_kwargs: the trainer's other arguments (``loss``,
            ``precision``, ...); a ``strategy`` passed is the one planned
            (see `space`).

    Example:
        ```python
        def make():
            return px.models.MLP(64, 10, key=jax.random.key(0))

        shapes = (jax.ShapeDtypeStruct((256, 64), jax.numpy.float32),
                  jax.ShapeDtypeStruct((256,), jax.numpy.int32))
        plan = px.plan(make, optax.adam(3e-4), shapes, budget="16MiB")
        print(plan)
        trainer = px.DataParallelTrainer(plan.model(make()), optax.adam(3e-4),
                                         **plan.trainer_kwargs())
        ```
    """
    build = model if not isinstance(model, eqx.Module) else (lambda: model)
    if not callable(build):
        raise TypeError(
            f"model={model!r} is neither an Equinox module nor a function "
            "building one; pass the model, or e.g. lambda: MyModel(key)"
        )
    if not (isinstance(trainer, type) and issubclass(trainer, DataParallelTrainer)):
        raise TypeError(
            f"trainer={trainer!r} is not px.DataParallelTrainer or a subclass of "
            "it; pass the class itself, e.g. trainer=MyTrainer"
        )
    built: list[DataParallelTrainer] = []

    # No strategy chosen: a mesh's, whose plan weighs every split.
    strategy = trainer_kwargs.pop("strategy", None)
    strategy = MeshStrategy() if strategy is None else strategy

    def construct() -> int:
        kwargs = {"progress": False, "strategy": strategy, **trainer_kwargs}
        built.append(trainer(build(), optimizer, **kwargs))
        return 0

    jax.eval_shape(construct)  # the trainer's parts, from shapes alone
    return built[0].plan(
        batch,
        budget=budget,
        space=space,
        margin=margin,
        device=device,
        devices=devices,
        measure=measure,
        progress=progress,
    )
