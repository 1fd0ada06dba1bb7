"""The options a strategy reads, checked before any run (train's, plan's):
one given to a strategy that does not read it, and a --mesh with a tensor
axis, each refused in one line. Reads the strategy registry, not JAX."""

from ..strategies._registry import lookup, registered
from ._args import UsageError
from ._values import mesh_sizes


# What each strategy-specific option does, for the message refusing it.
_OPTION_DOES = {"shard": "splits the state", "mesh": "sizes the axes"}


def check_strategy_options(strategy: str, given: dict[str, str | None]) -> None:
    """Refuse a strategy's own option (e.g. --shard) given with a strategy
    that does not read it, as the strategy registry says."""
    reads = lookup(strategy).options
    for option, value in given.items():
        if value is None or option in reads:
            continue
        owners = [entry.name for entry in registered() if option in entry.options]
        owner = " or ".join(f"--strategy {name}" for name in owners)
        raise UsageError(
            f"--{option} {value} {_OPTION_DOES.get(option, 'is an option')} of "
            f"{owner}, not of --strategy {strategy}; add {owner}, or drop "
            f"--{option}"
        )


def check_tensor_axis(mesh: str) -> None:
    """Refuse a --mesh with a tensor axis: it splits only what sharding
    rules say, and no option or config key of ``phalanx train`` gives rules,
    so its devices would each hold and compute the same."""
    sizes = mesh_sizes(mesh)
    tensor, fsdp = sizes["tensor"], sizes["fsdp"]
    if tensor == 1:
        return
    fsdp = fsdp * tensor if tensor > 0 and fsdp > 0 else -1
    data = sizes["data"] if fsdp > 0 else max(sizes["data"], 1)
    raise UsageError(
        f"--mesh {mesh}: the tensor axis splits the parameters only where "
        "sharding rules say, and phalanx train takes none (no option or config "
        f"key), so tensor={tensor} would hold and compute the same on each of "
        f"its devices; split the state over fsdp instead, e.g. --mesh "
        f"data={data},fsdp={fsdp}, or train in Python with "
        "px.MeshStrategy(tensor=..., rules=[...])"
    )
