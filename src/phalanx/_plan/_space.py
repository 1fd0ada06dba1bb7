"""The candidates a plan weighs (`PlanSpace` -> `Candidate`s): each mesh
split of the devices into data × fsdp × tensor (or the one layout of a
strategy planned as it is), each `Stacked` remat setting, and a number of
microbatches; and the strategy each stands for.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from .._contracts import AbstractStacked, with_static
from .._validate import is_int
from ..strategies import AccumulatingStrategy, MeshStrategy, Strategy
from ..strategies._names import strategy_name
from ..strategies._registry import entry_of
from ..strategies._rules import Rule


Remat = bool | Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class PlanSpace:
    """What a plan may choose among.

    Attributes:
        meshes: ``(data, fsdp, tensor)`` sizes whose product is the device
            count; None: every such split (``tensor > 1`` only with `rules`:
            without them the tensor axis splits nothing).
        microbatches: microbatch counts to try; None: 1, 2, 4, ... up to each
            device's share of the batch (the fewest that fit are searched
            for, by bisection).
        remat: the `Stacked` remat settings to try (bools or
            `jax.checkpoint_policies` policies); None: ``(False, True)``
            where the model has a `Stacked` stack, else its own.
        offload: whether to keep the optimizer state in host memory
            (`MeshStrategy`'s ``offload``); None: both where the devices
            offer host memory apart from their own (an accelerator's), else
            not (a CPU's host memory is its devices').
        rules: `MeshStrategy` sharding rules (as its argument).
        min_size: `MeshStrategy`'s ``min_size``.
        context: `MeshStrategy`'s ``context`` size, kept in every candidate
            (the other axes split the devices it leaves).
        sequence_dims: `MeshStrategy`'s ``sequence_dims``, with `context`.
        strategy: a strategy planned as it is, on its own devices: its
            layout kept, its microbatches (an `AccumulatingStrategy` around
            it) and remat weighed: a `ShardingStrategy`,
            `FullyShardedStrategy`, `PmapStrategy`, one `MeshStrategy`
            split, or any other. None: the trainer's own strategy where it
            is not a mesh (`Strategy.mesh_settings`) and the space sets no
            field of the mesh splits; else the mesh splits (the fields
            above but `microbatches`, `remat` and `min_size` are theirs,
            and stay unset with a strategy).
    """

    meshes: Sequence[tuple[int, int, int]] | None = None
    microbatches: Sequence[int] | None = None
    remat: Sequence[Remat] | None = None
    offload: Sequence[bool] | None = None
    rules: Sequence[Rule] = ()
    min_size: int = 2**12
    context: int = 1
    sequence_dims: Mapping[str, int] | int | None = None
    strategy: Strategy | None = None

    def __post_init__(self) -> None:
        counts = self.microbatches
        fix = (
            "pass microbatch counts, ints >= 1, e.g. microbatches=(1, 2, 4), or "
            "None for 1, 2, 4, ... up to each device's share of the batch"
        )
        if counts is not None:
            if isinstance(counts, str) or not isinstance(counts, Sequence):
                raise TypeError(f"microbatches={counts!r}: {fix}")
            if not counts or not all(is_int(k) and k >= 1 for k in counts):
                raise ValueError(f"microbatches={counts!r}: {fix}")
        if self.strategy is not None:
            _check_planned(self)

    @property
    def own_devices(self) -> list[Any] | None:
        """The devices of the space's `strategy` (None: it has none, the
        mesh splits are on the devices planned for)."""
        if self.strategy is None:
            return None
        return list(self.strategy.mesh.devices.flat)


def _check_planned(space: PlanSpace) -> None:
    """A space's `strategy` is one a plan can weigh the options of, and the
    space sets none of the mesh splits' fields."""
    strategy = space.strategy
    if isinstance(strategy, AccumulatingStrategy):
        raise TypeError(
            f"strategy={strategy_name(strategy)}: pass the strategy it wraps "
            f"({strategy_name(strategy.inner)}); the plan weighs microbatches "
            "itself (microbatches=(1, 2, 4) chooses among them)"
        )
    if not isinstance(strategy, Strategy):
        raise TypeError(
            f"strategy={strategy!r} is not a phalanx Strategy; pass one, e.g. "
            "strategy=px.FullyShardedStrategy(), or None for the mesh splits"
        )
    given = mesh_fields(space)
    if given:
        name, value = next(iter(given.items()))
        raise ValueError(
            f"{name}={value!r} sets a mesh split, but the space plans "
            f"strategy={strategy_name(strategy)} as it is; drop {name}, or "
            "strategy to weigh the mesh splits"
        )
    if space.microbatches is not None and strategy.per_device_reduce() is None:
        if any(k > 1 for k in space.microbatches):
            raise ValueError(
                f"microbatches={space.microbatches!r}: "
                f"{strategy_name(strategy)} cannot accumulate (it has no "
                "per-device program); pass microbatches=(1,)"
            )


def mesh_fields(space: PlanSpace) -> dict[str, Any]:
    """The fields of `space` set that only mesh splits read (meshes,
    offload, rules, context, sequence_dims), by name."""
    fields = {
        "meshes": space.meshes,
        "offload": space.offload,
        "rules": space.rules or None,
        "context": None if space.context == 1 else space.context,
        "sequence_dims": space.sequence_dims,
    }
    return {name: value for name, value in fields.items() if value is not None}


def planned_sizes(strategy: Strategy) -> tuple[int, int, int]:
    """``(data, fsdp, tensor)`` as `strategy` splits its devices: a mesh's
    own axes; else its batch's split (`batch_multiple`), over fsdp where
    its registry entry splits the state, over data where not."""
    if isinstance(strategy, MeshStrategy):
        shape = strategy.mesh.shape
        return shape["data"], shape["fsdp"], shape["tensor"]
    entry, split = entry_of(strategy), strategy.batch_multiple
    return (1, split, 1) if entry is not None and entry.splits_state else (split, 1, 1)


class Candidate(NamedTuple):
    """One layout a plan weighs: a mesh split, a remat setting (None: the
    model's own, no `Stacked` in it), a microbatch count, whether the
    optimizer state is kept in host memory, the space's ``context``, and
    the name of the space's `strategy` where it plans one as it is (its
    layout's sizes then those above)."""

    data: int
    fsdp: int
    tensor: int
    microbatches: int
    remat: Remat | None
    offload: bool = False
    context: int = 1
    named: str = ""

    def strategy(self, space: PlanSpace, devices: Sequence[Any]) -> Strategy:
        """The strategy this candidate trains with on `devices` (a space's
        own `strategy`: on its own devices).

        Raises:
            ValueError: `devices` are not the space's strategy's.
        """
        own = space.own_devices
        if space.strategy is not None:
            if own != list(devices):
                raise ValueError(
                    f"devices={list(devices)!r}: the plan's {self.named} is "
                    f"built on {own!r}; pass those, or None"
                )
            return self._accumulate(space.strategy)
        mesh = MeshStrategy(
            list(devices),
            data=self.data,
            fsdp=self.fsdp,
            tensor=self.tensor,
            context=self.context,
            sequence_dims=space.sequence_dims,
            rules=list(space.rules),
            min_size=space.min_size,
            offload=self.offload,
        )
        return self._accumulate(mesh)

    def _accumulate(self, strategy: Strategy) -> Strategy:
        if self.microbatches == 1:
            return strategy
        return AccumulatingStrategy(strategy, microbatches=self.microbatches)

    @property
    def sizes(self) -> str:
        """The layout as the table's first column shows it: the mesh's
        ``data·fsdp·context·tensor``, or the strategy's name."""
        return self.named or f"{self.data}·{self.fsdp}·{self.context}·{self.tensor}"

    def describe(self) -> str:
        """E.g. ``"data=2 fsdp=4 tensor=1, 2 microbatches, remat=True"``
        (``context=K`` before ``tensor`` where it splits sequences; a
        strategy planned as it is by its name)."""
        context = f"context={self.context} " if self.context > 1 else ""
        text = self.named or (
            f"data={self.data} fsdp={self.fsdp} {context}tensor={self.tensor}"
        )
        if self.microbatches > 1:
            text += f", {self.microbatches} microbatches"
        if self.remat is not None:
            text += f", remat={remat_name(self.remat)}"
        if self.offload:
            text += ", optimizer state on the host"
        return text


def remat_name(remat: Remat) -> str:
    """A remat setting as its policy's name (``dots_saveable``) or bool."""
    return (
        str(remat)
        if isinstance(remat, bool)
        else getattr(remat, "__name__", repr(remat))
    )


def mesh_splits(devices: int, space: PlanSpace) -> list[tuple[int, int, int]]:
    """The space's ``(data, fsdp, tensor)`` splits of `devices` (what its
    ``context`` axis leaves of them).

    Raises:
        ValueError: ``context`` does not divide `devices`, or a mesh of the
            space's does not multiply to what it leaves.
    """
    if space.strategy is not None:  # its own layout, on its own devices
        return [planned_sizes(space.strategy)]
    context = space.context
    if not is_int(context) or context < 1 or devices % context:
        raise ValueError(
            f"context={context!r} does not divide the {devices} devices; pass a "
            f"divisor of {devices} (1: no sequence split), e.g. "
            f"context={next((d for d in _divisors(devices) if d > 1), 1)}"
        )
    devices //= context
    if space.meshes is not None:
        for i, m in enumerate(space.meshes):
            if len(m) != 3 or not all(is_int(s) and s >= 1 for s in m):
                raise ValueError(
                    f"meshes[{i}]={m!r}: pass (data, fsdp, tensor) sizes, ints "
                    f">= 1 whose product is {devices}, e.g. ({devices}, 1, 1)"
                )
            if math.prod(m) != devices:
                raise ValueError(
                    f"meshes[{i}]={tuple(m)!r}: data × fsdp × tensor is "
                    f"{math.prod(m)}, not the {devices} devices"
                    + (f" that context={context} leaves" if context > 1 else "")
                    + f"; pass sizes whose product is {devices}, e.g. "
                    f"({devices}, 1, 1)"
                )
        return [tuple(m) for m in space.meshes]  # pyright: ignore[reportReturnType]
    splits = []
    for tensor in _divisors(devices):
        if tensor > 1 and not space.rules:
            continue
        for fsdp in _divisors(devices // tensor):
            splits.append((devices // tensor // fsdp, fsdp, tensor))
    return splits


def microbatch_counts(per_device: int, space: PlanSpace) -> list[int]:
    """The microbatch counts to try for `per_device` examples a device (1
    alone for a space's strategy that cannot accumulate)."""
    if space.strategy is not None and space.strategy.per_device_reduce() is None:
        return [1]
    if space.microbatches is not None:
        counts = sorted(set(space.microbatches))
    else:
        counts = [2**i for i in range(per_device.bit_length()) if 2**i <= per_device]
    return [k for k in counts if per_device % k == 0]


def has_stack(model: Any) -> bool:
    """Whether `model` holds a `Stacked` (or other `AbstractStacked`) stack."""
    return any(
        isinstance(node, AbstractStacked)
        for node in jax.tree.leaves(
            model, is_leaf=lambda x: isinstance(x, AbstractStacked)
        )
    )


def with_remat(tree: Any, remat: Remat | None) -> Any:
    """`tree` (a model, or the static part of a state) with every
    `Stacked` stack in it set to `remat` (None: unchanged)."""
    if remat is None:
        return tree

    def set_remat(node: Any) -> Any:
        if not isinstance(node, AbstractStacked) or not hasattr(node, "remat"):
            return node
        return with_static(node, remat=remat)

    return jax.tree.map(
        set_remat, tree, is_leaf=lambda x: isinstance(x, AbstractStacked)
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
