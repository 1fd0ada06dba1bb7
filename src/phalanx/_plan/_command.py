"""The ``phalanx train`` command of a plan's choice (`train_command`): the
options of the run planned, less their layout, then the chosen layout's
flags: a mesh split's ``--strategy mesh --mesh ...``, or a strategy planned
as it is by its registry name (and ``--shard`` or ``--mesh``), and
``--microbatches``."""

import shlex
from collections.abc import Sequence

from ..strategies import FullyShardedStrategy, MeshStrategy, Strategy
from ..strategies._registry import entry_of
from ._space import Candidate, PlanSpace, remat_name


# What ends each refusal: the Python API says every layout.
_FIX = "train with plan.model(model) and plan.trainer_kwargs()"


def train_command(space: PlanSpace, chosen: Candidate, flags: Sequence[str]) -> str:
    """``phalanx train`` with `flags` (less the layout's) and `chosen`'s.

    Raises:
        ValueError: the choice splits over ``tensor`` (rules: the Python API
            only), splits sequences over ``context`` other than along
            dimension 1 of every batch leaf (what ``--mesh context=K``
            splits), or sets a remat policy (the model's own: no flag sets
            it); or the space's strategy is one phalanx train cannot build
            (not registered, or with settings it has no flag for).
    """
    if chosen.remat is not None and not isinstance(chosen.remat, bool):
        raise ValueError(
            f"the choice sets remat={remat_name(chosen.remat)}, a policy no flag "
            f"of phalanx train sets; {_FIX}"
        )
    if space.strategy is not None:
        layout = _own_layout(space.strategy, chosen)
    else:
        layout = ["--strategy", "mesh", "--mesh", _mesh_sizes(space, chosen)]
    if chosen.microbatches > 1:
        layout += ["--microbatches", str(chosen.microbatches)]
    return shlex.join(["phalanx", "train", *_without_layout(flags), *layout])


def _mesh_sizes(space: PlanSpace, chosen: Candidate) -> str:
    """``--mesh``'s value for a mesh split of the space."""
    if chosen.tensor > 1:
        raise ValueError(
            "the choice splits over tensor, which needs sharding rules; "
            f"phalanx train takes none: {_FIX}"
        )
    mesh = f"data={chosen.data},fsdp={chosen.fsdp}"
    if chosen.context > 1:
        if space.sequence_dims != 1:
            raise ValueError(
                f"the choice splits sequences by sequence_dims="
                f"{space.sequence_dims!r}; phalanx train --mesh context=K "
                f"splits dimension 1 of every batch leaf: {_FIX}"
            )
        mesh += f",context={chosen.context}"
    return mesh


def _own_layout(strategy: Strategy, chosen: Candidate) -> list[str]:
    """The flags of a strategy planned as it is."""
    entry = entry_of(strategy)
    if entry is None:
        raise ValueError(
            f"{chosen.named} is not a registered strategy, which phalanx train "
            f"cannot build; {_FIX}"
        )
    layout = ["--strategy", entry.name]
    if isinstance(strategy, FullyShardedStrategy) and strategy.shard != "all":
        layout += ["--shard", strategy.shard]
    if isinstance(strategy, MeshStrategy):
        settings = strategy.mesh_settings()
        shape = strategy.mesh.shape
        by_dim_1 = settings.context == 1 or settings.sequence_dims == 1
        if shape["tensor"] > 1 or settings.rules or settings.offload or not by_dim_1:
            raise ValueError(
                f"{chosen.named} has sharding rules, a tensor axis, offload or "
                "sequences split other than along dimension 1, which phalanx "
                f"train does not take; {_FIX}"
            )
        sizes = [f"{axis}={shape[axis]}" for axis in ("data", "fsdp", "context")]
        layout += ["--mesh", ",".join(sizes)]
    return layout


def _without_layout(flags: Sequence[str]) -> list[str]:
    """`flags` without the layout options the plan sets."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
            continue
        name = flag.split("=", 1)[0]
        if name in ("--strategy", "--mesh", "--microbatches", "--shard"):
            skip = "=" not in flag
            continue
        out.append(flag)
    return out
