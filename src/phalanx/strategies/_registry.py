"""The one list of phalanx's strategies: each entry names a strategy, says
how to build it on some devices, which options it reads and what it can do.

Everything that enumerates strategies reads this list, at the time it asks
(never a copy made at import): the CLI's ``--strategy`` choices and their
options, the default set-ups of `phalanx.testing.assert_equivalent`, the
name `strategy_name` gives a strategy, and the tests' strategy matrix. A
strategy added here appears in all of them. The wrapper
`AccumulatingStrategy` is no entry: it wraps any entry that `accumulates`
(`build`'s `microbatches`). This module builds strategies; it places no
arrays.

It imports no JAX: the command line's parser reads it to list the choices
of ``--strategy`` (``phalanx train --help`` answers without starting JAX).
Each entry names its class, and its `build` reaches the class through the
lazily imported `phalanx.strategies` when it is called.
"""

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

from .. import strategies as st


# A built strategy: a `phalanx.Strategy` (not named here: it would import JAX).
Built = Any


class Options(NamedTuple):
    """What a caller may say about the strategy it builds; each entry reads
    the fields its `Registered.options` names and ignores the others.

    Attributes:
        min_size: ``min_size(n)``: the size below which a leaf stays whole
            when the state is split over n devices (None: the strategy's
            default). Tests pass ``lambda n: 1`` to split a tiny model.
        shard: `FullyShardedStrategy`'s: ``"all"`` or ``"optimizer"``
            (None: its default).
        mesh: `MeshStrategy`'s axis sizes (None: hybrid sharding: ``data``
            2 on an even device count, ``fsdp`` the rest); a ``context``
            axis splits dimension 1 of every batch leaf.
        deterministic: add the devices' sums in a fixed order.
    """

    min_size: Callable[[int], int] | None = None
    shard: Literal["all", "optimizer"] | None = None
    mesh: Mapping[str, int] | None = None
    deterministic: bool = False


@dataclasses.dataclass(frozen=True)
class Registered:
    """One strategy as the registry lists it.

    Attributes:
        name: its short name: the CLI's ``--strategy`` choice and the
            tests' kind (``"sharding"``).
        strategy: the name of the class it builds (``"ShardingStrategy"``).
        summary: one line for the CLI's help.
        build: ``build(devices, options) -> strategy`` on `devices` (None:
            all, an int: the first n, or a sequence of devices), as the
            class's `devices` argument takes them.
        options: the fields of `Options` it reads (the CLI refuses a
            strategy's own flags with another strategy).
        variants: other set-ups of it the tests' matrix covers, by name
            (``{"zero2": Options(shard="optimizer")}``).
        accumulates: whether `AccumulatingStrategy` can wrap it: it declares
            a per-device program (`Strategy.per_device_reduce`).
        fits: ``fits(n)``: whether its default set-up suits n devices (the
            default `assert_equivalent` set-ups and the tests' matrix skip
            it elsewhere).
        details: ``details(strategy)``: what `strategy_name` shows in
            parentheses after the class's name ("" for nothing).
    """

    name: str
    strategy: str
    summary: str
    build: Callable[[Any, Options], Built]
    options: frozenset[str] = frozenset()
    variants: Mapping[str, Options] = dataclasses.field(default_factory=dict)
    accumulates: bool = True
    fits: Callable[[int], bool] = lambda n: True
    details: Callable[[Built], str] = lambda strategy: ""

    @property
    def splits_state(self) -> bool:
        """Whether it splits the training state over devices (it reads a
        `min_size`)."""
        return "min_size" in self.options


def _min_size(options: Options, devices: int) -> dict[str, int]:
    """The `min_size` keyword for state split over `devices`, if given."""
    if options.min_size is None:
        return {}
    return {"min_size": options.min_size(devices)}


def _fully_sharded(devices: Any, options: Options) -> Built:
    n = st.ShardingStrategy(devices).num_devices
    sized = _min_size(options, n)
    return st.FullyShardedStrategy(devices, shard=options.shard or "all", **sized)


def _hybrid(n: int) -> dict[str, int]:
    """Hybrid sharding on n devices: replicated over 2 (where n is even),
    split over the rest."""
    return {"data": 2 if n % 2 == 0 else 1, "fsdp": -1}


def _mesh(devices: Any, options: Options) -> Built:
    if options.mesh is None:
        sizes = _hybrid(st.ShardingStrategy(devices).num_devices)
    else:
        sizes = dict(options.mesh)
    data, fsdp = sizes.get("data", -1), sizes.get("fsdp", 1)
    context, tensor = sizes.get("context", 1), sizes.get("tensor", 1)
    # A context axis splits dimension 1 of every batch leaf: (examples,
    # sequence, ...) tokens and targets, as a command line's data come.
    mesh = functools.partial(
        st.MeshStrategy,
        devices,
        data=data,
        fsdp=fsdp,
        context=context,
        tensor=tensor,
        sequence_dims=1 if context != 1 else None,
    )
    strategy = mesh()
    if options.min_size is None:
        return strategy
    # min_size for the fsdp axis, as the strategy resolved its size.
    return mesh(min_size=options.min_size(strategy.mesh.shape["fsdp"]))


def _mesh_sizes(strategy: Built) -> str:
    """A mesh's axis sizes above 1 (``data=1`` where none is), and
    ``offload=True`` where its declared settings (`mesh_settings`) say so."""
    sizes = dict(strategy.mesh.shape)
    shown = [f"{axis}={size}" for axis, size in sizes.items() if size > 1]
    settings = strategy.mesh_settings()
    if settings is not None and settings.offload:
        shown.append("offload=True")
    return ", ".join(shown or ["data=1"])


def _replicating(name: str, strategy: str, summary: str) -> Registered:
    """The entry of a strategy that keeps the whole state on every device:
    its class takes the devices and `deterministic`, its one option."""

    def build(devices: Any, options: Options) -> Built:
        return getattr(st, strategy)(devices, deterministic=options.deterministic)

    return Registered(
        name, strategy, summary, build, options=frozenset({"deterministic"})
    )


REGISTRY: tuple[Registered, ...] = (
    _replicating(
        "sharding", "ShardingStrategy", "ShardingStrategy (jit over sharded arrays)"
    ),
    _replicating("pmap", "PmapStrategy", "PmapStrategy (per-device program)"),
    Registered(
        "fsdp",
        "FullyShardedStrategy",
        "FullyShardedStrategy (the state split over the devices)",
        _fully_sharded,
        options=frozenset({"shard", "min_size"}),
        variants={"zero2": Options(shard="optimizer")},
    ),
    Registered(
        "mesh",
        "MeshStrategy",
        "MeshStrategy (a data x fsdp x tensor mesh: --mesh)",
        _mesh,
        options=frozenset({"mesh", "min_size"}),
        fits=lambda n: n >= 4 and n % 2 == 0,
        details=_mesh_sizes,
    ),
)


def registered() -> tuple[Registered, ...]:
    """Every registered strategy, in order (read when asked: a strategy
    added to `REGISTRY` is seen by every reader)."""
    return REGISTRY


def lookup(name: str) -> Registered:
    """The entry named `name`.

    Raises:
        ValueError: no strategy is registered under `name`.
    """
    for entry in registered():
        if entry.name == name:
            return entry
    names = ", ".join(entry.name for entry in registered())
    raise ValueError(f"strategy {name!r} is not registered; choose one of {names}")


def entry_of(strategy: Built) -> Registered | None:
    """The entry that builds `strategy`'s class (None: not registered)."""
    for entry in registered():
        if type(strategy).__name__ == entry.strategy:
            return entry
    return None


def build(
    name: str,
    devices: Any = None,
    options: Options | None = None,
    microbatches: int = 1,
) -> Built:
    """The strategy registered as `name` on `devices`, wrapped in an
    `AccumulatingStrategy` of `microbatches` where that is above 1.

    Raises:
        ValueError: `name` is not registered, or the options do not fit
            the devices.
        TypeError: `microbatches` > 1 for a strategy that cannot accumulate.
    """
    entry = lookup(name)
    strategy = entry.build(devices, Options() if options is None else options)
    if microbatches > 1:
        if not entry.accumulates:
            raise TypeError(
                f"strategy {name!r} cannot accumulate microbatches={microbatches}; "
                "use microbatches=1 or a strategy that runs per device"
            )
        return st.AccumulatingStrategy(strategy, microbatches)
    return strategy
