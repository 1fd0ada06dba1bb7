"""Strategies on a named device mesh: building the mesh, and the abstract
`DeviceMeshStrategy` that implements once what the built-in strategies share.

A mesh strategy says three things, and the base derives the rest: its `mesh`,
the mesh axes a batch is split over (`axis_name`), and where each floating
array of the parameters and optimizer state is split (`state_spec`). From
these come the device count, the batch's sharding and padding multiple, the
state's shardings, and the per-device program with its one reduction. The
concrete strategies (`ShardingStrategy`, `PmapStrategy`,
`FullyShardedStrategy`, `MeshStrategy`) only add how their step runs
(`reduce`, `map`; `MeshStrategy` its own per-device program too). This
module places no arrays and compiles nothing.
"""

import abc
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree
from typing_extensions import override

from .._typing import Devices
from ._per_device import (
    _shard_map,
    axis_name_of,
    shard_map_apply,
    shard_map_reduce,
    spec_axes,
)
from ._placement import available_devices, named
from ._strategy import AxisName, LocalFn, MapFn, PerDeviceStrategy


# What an array of the training state is to the step: one of the model's
# floating-point parameters (gathered where the step uses it, its gradient
# laid out as the optimizer state), or one of the optimizer's.
StateRole: TypeAlias = Literal["parameters", "optimizer_state"]


def make_mesh(devices: Devices, axes: str | Mapping[str, int]) -> Mesh:
    """A mesh over the chosen devices: this process's, or in a multi-process
    run every process's (`jax.devices()`).

    The devices fill the mesh in order, the last axis varying fastest: the
    consecutive devices of one process share the coordinates of the earlier
    axes, so with one process per host an axis within a host goes last.

    Args:
        devices: None for all, an int for the first n, or a sequence.
        axes: one name for a 1-D mesh of all the devices, or the axes'
            names and sizes in order (one size may be -1: what is left).

    Raises:
        ValueError: `devices` asks for more devices than exist, or none; or
            the axes' sizes do not multiply to the devices' count.
        TypeError: `devices` is neither None, an int nor a sequence of devices.
    """
    chosen = _chosen(devices)
    sizes = {axes: -1} if isinstance(axes, str) else dict(axes)
    known = math.prod(size for size in sizes.values() if size != -1)
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1 or known < 1 or len(chosen) % known:
        raise ValueError(
            f"mesh axes {sizes} do not fit {len(chosen)} devices: the sizes must "
            f"multiply to {len(chosen)}, with at most one -1 (what is left); "
            f"e.g. {{'data': -1}}"
        )
    if free:
        sizes[free[0]] = len(chosen) // known
    elif known != len(chosen):
        raise ValueError(
            f"mesh axes {sizes} multiply to {known}, not to the {len(chosen)} "
            "devices chosen; give one axis the size -1 (what is left), or "
            "choose as many devices"
        )
    grid = np.array(chosen).reshape(tuple(sizes.values()))
    # Auto axes: jit propagates shardings through reshapes and vmaps on its own.
    return Mesh(grid, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def _chosen(devices: Devices) -> list[Any]:
    """The devices `devices` asks for, checked."""
    available = available_devices()
    if devices is None:
        return list(available)
    if isinstance(devices, bool | str) or not isinstance(devices, int | Sequence):
        raise TypeError(
            f"devices={devices!r} is not supported; pass None (all local devices), "
            "an int (the first n) or a sequence of jax devices"
        )
    if isinstance(devices, int):
        if not 1 <= devices <= len(available):
            raise ValueError(
                f"devices={devices} but this process sees {len(available)} "
                f"{available[0].platform} device(s); pass an int from 1 to "
                f"{len(available)}, or devices=None for all of them"
            )
        return list(available[:devices])
    chosen = list(devices)
    if not chosen:
        raise ValueError("devices=[] is empty; pass at least one device or None")
    unknown = [d for d in chosen if d not in available]
    if unknown or len(set(chosen)) != len(chosen):
        raise ValueError(
            f"devices={chosen!r} must be distinct devices of this process; "
            f"choose from jax.local_devices() = {available!r}"
        )
    return chosen


class DeviceMeshStrategy(PerDeviceStrategy):
    """A strategy on a named device mesh, with the batch split over some of
    its axes: the members every such strategy shares, implemented once.

    A subclass gives its `mesh`, the axes a batch is split over
    (`axis_name`), whether its one reduction adds in a fixed order
    (`deterministic`), where state is split (`state_spec`), and how its step
    runs (`reduce` and `map`, usually `fn` itself in the global view of
    `jax.jit`, or `reduce_per_device` and `map_per_device`). The base
    derives the rest:

    - `num_devices`: the mesh's devices;
    - `batch_sharding`: the examples axis split over the batch axes, and
      whole along every other mesh axis;
    - `batch_multiple`: the product of the batch axes' sizes, so a step's
      batch pads to one equal slice per position along them;
    - `state_shardings`: from the state's structure: the model's floating
      parameters and the optimizer state as `state_spec` says, everything
      else (step, key, integer arrays, model state, loss scale) whole on
      every device;
    - `reduce_per_device` and `map_per_device`: each device its slice in
      `jax.shard_map` over the batch axes, split parameters gathered whole
      first, and one reduction after: gradients leave summed and laid out
      as the optimizer state (a reduce-scatter where it is split), the
      other sums and model state in one all-reduce.

    Example:
        A data-parallel strategy on a 2 × 4 mesh, the batch split over both
        axes and the optimizer state over the second:

        ```python
        class TwoAxes(px.strategies.DeviceMeshStrategy):
            mesh: Mesh
            axis_name: tuple[str, str] = ("hosts", "chips")
            deterministic: bool = False

            def __init__(self):
                devices = np.array(jax.devices()).reshape(2, 4)
                self.mesh = Mesh(devices, self.axis_name)

            def state_spec(self, role, leaf):
                if role == "optimizer_state" and leaf.shape[0] % 4 == 0:
                    return P("chips")
                return P()

            def reduce(self, fn, replicated, carry, examples):
                return self.reduce_per_device(fn, replicated, carry, examples)

            def map(self, fn, replicated, examples):
                return self.map_per_device(fn, replicated, examples)
        ```
    """

    mesh: eqx.AbstractVar[Mesh]
    axis_name: eqx.AbstractVar[AxisName]
    # Whether the one reduction adds the slices' sums in a fixed device order
    # (an all-gather, then additions) instead of an all-reduce.
    deterministic: eqx.AbstractVar[bool]

    @abc.abstractmethod
    def state_spec(self, role: StateRole, leaf: jax.ShapeDtypeStruct) -> P:
        """Where one floating-point array of the parameters or the optimizer
        state is split over the mesh.

        Asked for each floating array of at least one dimension of the
        model (``role="parameters"``) and of the optimizer state
        (``"optimizer_state"``); every other array of the state is whole on
        every device. Inside the step the same rule says where a parameter
        is gathered from (``"parameters"``) and where each sum a slice
        returns is scattered to (``"optimizer_state"``: a gradient has its
        parameter's shape, and so do an optimizer's moments), so it sees a
        shape and dtype, not a path: the gradient then reaches each device
        laid out as the optimizer state it updates.

        Args:
            role: what the array is to the step.
            leaf: its shape and dtype.

        Returns:
            A `PartitionSpec` of at most ``len(leaf.shape)`` entries, each
            None or mesh axes whose sizes' product divides that dimension;
            ``P()`` keeps the array whole on every device. Inside the
            per-device program only the batch axes are split by hand; a
            split over another mesh axis is left to the compiler.
        """

    def __check_init__(self):
        axes = self.batch_axes
        if (
            not axes
            or len(set(axes)) != len(axes)
            or any(axis not in self.mesh.axis_names for axis in axes)
        ):
            raise ValueError(
                f"{type(self).__name__}: axis_name={self.axis_name!r} must name "
                f"one or more distinct axes of its mesh {self.mesh.axis_names}, "
                f"the axes a batch is split over; e.g. "
                f"axis_name={self.mesh.axis_names[0]!r}"
            )

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes a batch is split over, as a tuple (`axis_name` is
        one name for one axis)."""
        name = self.axis_name
        return (name,) if isinstance(name, str) else tuple(name)

    @property
    @override
    def batch_sharding(self) -> NamedSharding:
        return named(self.mesh, P(axis_name_of(self.batch_axes)))

    @property
    @override
    def batch_multiple(self) -> int:
        shape = self.mesh.shape
        return math.prod(shape[axis] for axis in self.batch_axes)

    @property
    @override
    def num_devices(self) -> int:
        return self.mesh.size  # every device of the mesh runs the step

    @override
    def state_shardings(self, state: PyTree[Any]) -> PyTree[NamedSharding]:
        whole = named(self.mesh, P())

        def by(role: StateRole):
            return lambda leaf: named(self.mesh, self._spec(role, leaf))

        return eqx.tree_at(
            lambda s: (s.model, s.opt_state),
            jax.tree.map(lambda _: whole, state),
            (
                jax.tree.map(by("parameters"), state.model),
                jax.tree.map(by("optimizer_state"), state.opt_state),
            ),
        )

    @override
    def reduce_per_device(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        axes, scattered = self.batch_axes, None
        if not self.deterministic and self._in_step("optimizer_state", replicated):
            # The sums' shapes (a trace, nothing runs) decide which are scattered.
            name = axis_name_of(axes)
            whole = _shard_map(fn, self.mesh, axes, (P(), P(), P(name)), (P(), P()))
            sums = jax.eval_shape(whole, replicated, carry, examples)[0]
            scattered = self._in_step("optimizer_state", sums)
        return shard_map_reduce(
            self.mesh,
            axes,
            fn,
            replicated,
            carry,
            examples,
            deterministic=self.deterministic,
            gathered=self._in_step("parameters", replicated),
            scattered=scattered,
        )

    def map_per_device(self, fn: MapFn, replicated: PyTree, examples: PyTree) -> PyTree:
        """`map` as a per-device program: `fn` on each device's slice, with
        split parameters gathered whole first; outputs stay split."""
        gathered = self._in_step("parameters", replicated)
        return shard_map_apply(
            self.mesh, self.batch_axes, fn, replicated, examples, gathered=gathered
        )

    def _spec(self, role: StateRole, leaf: Any) -> P:
        """`state_spec` of a leaf (P() for one it is not asked about), checked.

        Raises:
            ValueError: the spec names an unknown axis, an axis twice, more
                dimensions than the leaf has, or a split that does not divide.
        """
        shape = tuple(leaf.shape)
        if not shape or not jnp.issubdtype(leaf.dtype, jnp.inexact):
            return P()
        spec = self.state_spec(role, jax.ShapeDtypeStruct(shape, leaf.dtype))
        if not _splits(spec, shape, dict(self.mesh.shape)):
            raise ValueError(
                f"{type(self).__name__}.state_spec({role!r}, {leaf.dtype}"
                f"{list(shape)}) returned {spec!r}, which does not split that "
                f"array over the mesh {dict(self.mesh.shape)}: return a "
                "PartitionSpec naming each mesh axis at most once, on a "
                "dimension its size divides, or P() to keep it whole"
            )
        return spec

    def _in_step(self, role: StateRole, tree: PyTree) -> PyTree[P] | None:
        """Where each leaf of `tree` (arrays inside the step) is split over
        the batch axes, by its role's rule; None if nothing is."""
        axes = self.batch_axes

        def manual(x: Any) -> P:
            entries = [
                tuple(axis for axis in spec_axes(entry) if axis in axes)
                for entry in self._spec(role, x)
            ]
            return P(*[axis_name_of(e) if e else None for e in entries])

        specs = jax.tree.map(manual, tree)
        split = any(spec_axes(e) for spec in jax.tree.leaves(specs) for e in spec)
        return specs if split else None


def _splits(spec: object, shape: tuple[int, ...], sizes: dict[str, int]) -> bool:
    """Whether `spec` is a `PartitionSpec` that splits an array of `shape`
    evenly over mesh axes of these `sizes`, each named at most once."""
    if not isinstance(spec, P) or len(spec) > len(shape):
        return False
    names = [axis for entry in spec for axis in spec_axes(entry)]
    if len(set(names)) != len(names) or any(axis not in sizes for axis in names):
        return False
    return all(
        length % math.prod(sizes[axis] for axis in spec_axes(entry)) == 0
        for entry, length in zip(spec, shape[: len(spec)], strict=True)
    )
