"""A trainer's plan (`plan_trainer`): its step, under each candidate layout
of the space, built and compiled on abstract arguments from its own parts
(its hooks, optimizer, precision and state's structure, never its arrays),
for batches shaped like the one given."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._assembly._parts import TrainerParts
from .._engine.feed._batch_checks import num_examples
from .._engine.program._spec import BatchSpec
from .._typing import validates_own_arguments
from .._validate import boolean, integer, is_real
from ..strategies import AccumulatingStrategy, Strategy
from ._devices import budget_bytes, device_spec
from ._measure import Builder
from ._options import PlanOptions, Settings
from ._result import Plan
from ._search import search
from ._space import PlanSpace, has_stack, mesh_fields, mesh_splits


@validates_own_arguments
def plan_trainer(parts: TrainerParts, batch: Any, **options: Any) -> Plan:
    """The plan of a trainer's step for batches like `batch` (see
    `DataParallelTrainer.plan`; `options` are `PlanOptions`)."""
    asked = PlanOptions(**options)
    built = parts.programs.parts
    step = built.step
    space = _space_of(asked.space, step.strategy)
    chosen = _devices(asked.devices, space.own_devices)
    margin = asked.margin
    if not is_real(margin):
        raise TypeError(
            f"margin={margin!r} must be a number in [0, 1): the share of the "
            "budget kept free, e.g. 0.1"
        )
    margin = float(margin)
    if not 0 <= margin < 1:
        raise ValueError(
            f"margin={margin!r} must be in [0, 1): the share of the budget kept "
            "free, e.g. 0.1"
        )
    measure = integer("measure", asked.measure, minimum=0, example="measure=3")
    progress = asked.progress
    if progress is not None:
        progress = boolean("progress", progress)
    budget = budget_bytes(asked.budget, chosen)
    mesh_splits(len(chosen), space)  # the meshes checked before any trace
    cost = device_spec(
        asked.device, chosen[0].device_kind, step.precision.compute, devices=chosen
    )
    spec, size = _spec(parts, batch)
    builder = Builder(
        step,
        parts.layout,
        traced_checks=built.traced_checks,
        spec=spec,
        size=size,
    )
    model = builder.abstract_model
    remats = (
        list(space.remat)
        if space.remat is not None
        else ([False, True] if has_stack(model) else [None])
    )
    settings = Settings(chosen, space, budget, margin, cost, measure, progress)
    return search(builder, remats, settings)


def _devices(devices: int | Sequence[Any] | None, own: list[Any] | None) -> list[Any]:
    """The devices planned for: `devices` as asked, checked; those of the
    space's strategy (`own`) where it has them, which `devices` must be."""
    if own is not None:
        if devices is not None and _devices(devices, None) != own:
            raise ValueError(
                f"devices={devices!r}: the strategy planned is built on its own "
                f"{len(own)} devices ({own!r}); pass devices=None, or a strategy "
                "built on the devices to plan for"
            )
        return own
    every = jax.devices()
    if devices is None:
        return every
    fix = f"pass a count from 1 to {len(every)}, or a list of devices"
    example = f"{fix} (e.g. jax.devices()[:4])"
    if isinstance(devices, bool | str) or not isinstance(devices, int | Sequence):
        raise TypeError(f"devices={devices!r}: {example}")
    if isinstance(devices, int):
        if not 1 <= devices <= len(every):
            raise ValueError(
                f"devices={devices!r}: JAX sees {len(every)} devices; {fix}"
            )
        return every[:devices]
    for each in devices:
        if not isinstance(each, jax.Device):
            raise TypeError(
                f"devices contains {each!r}, which is not a jax.Device; {example}"
            )
    if not devices:
        raise ValueError(f"devices={devices!r} is empty; {example}")
    return list(devices)


def _space_of(space: PlanSpace | None, strategy: Strategy) -> PlanSpace:
    """`space`, or the trainer's strategy's: a strategy that declares mesh
    settings (`Strategy.mesh_settings`: a `MeshStrategy`'s rules, min_size,
    context axis and sequence dims) is planned over the mesh splits of its
    devices, with them (offload is the planner's own to weigh); any other
    (a `ShardingStrategy`, `FullyShardedStrategy`, ...) as it is, its
    microbatches and remat weighed, also in a space given that sets no
    field of the mesh splits. An `AccumulatingStrategy` is planned as the
    strategy it wraps."""
    if isinstance(strategy, AccumulatingStrategy):
        strategy = strategy.inner
    settings = strategy.mesh_settings()
    if space is not None:
        if not isinstance(space, PlanSpace):
            raise TypeError(
                f"space={space!r} is not a px.PlanSpace; pass e.g. "
                "px.PlanSpace(rules=[...], microbatches=(1, 2, 4))"
            )
        if space.strategy is None and settings is None and not mesh_fields(space):
            return dataclasses.replace(space, strategy=strategy)
        return space
    if settings is None:
        return PlanSpace(strategy=strategy)
    return PlanSpace(
        rules=list(settings.rules),
        min_size=settings.min_size,
        context=settings.context,
        sequence_dims=settings.sequence_dims,
    )


def _spec(parts: TrainerParts, batch: Any) -> tuple[BatchSpec, int]:
    """The spec of `batch` (arrays, or `jax.ShapeDtypeStruct`s) and its
    examples."""
    inputs, targets = parts.pipeline.inputs_and_targets(batch)
    leaves, treedef = jax.tree.flatten((inputs, targets))
    if not leaves or not all(
        hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves
    ):
        raise TypeError(
            f"batch={batch!r}: pass a batch of arrays, or of jax.ShapeDtypeStruct "
            "(its shapes), e.g. (jax.ShapeDtypeStruct((256, 784), jnp.float32), "
            "jax.ShapeDtypeStruct((256,), jnp.int32))"
        )
    n = int(num_examples(leaves, treedef, "batch"))
    shapes = tuple(tuple(leaf.shape[1:]) for leaf in leaves)
    dtypes = tuple(np.dtype(leaf.dtype) for leaf in leaves)
    return BatchSpec(treedef, shapes, dtypes, n), n
