"""The strategy contract: what every strategy answers, and nothing it does.

`Strategy` is the interface the trainer, the compiled steps, the batch
pipeline, checkpoints, `save_model` and the planner talk to; its
capabilities are declared on it (`per_device_reduce`, `mesh_settings`), so
that no caller asks which class it holds. `PerDeviceStrategy` implements
the per-device program that `AccumulatingStrategy` and mixed precision
need. This module holds no behaviour: the members built-in strategies
share are implemented once in `DeviceMeshStrategy` (``_device_mesh.py``),
and the concrete ones are final.
"""

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import equinox as eqx
from jax.sharding import Mesh, Sharding
from jaxtyping import PyTree
from typing_extensions import override

from ._rules import Rule


# ``fn(replicated, carry, examples) -> (sums, carry)``: the work of one slice of
# examples. ``sums`` are additive over examples (weighted loss, gradients, ...);
# ``carry`` is model state threaded through the step (e.g. BatchNorm averages).
LocalFn: TypeAlias = Callable[[Any, Any, Any], tuple[Any, Any]]
# ``reduce(fn, replicated, carry, examples) -> (sums, carry)``: `Strategy.reduce`'s
# signature, as `Strategy.per_device_reduce` hands a per-device one out.
Reduce: TypeAlias = Callable[[LocalFn, Any, Any, Any], tuple[Any, Any]]
# ``fn(replicated, examples) -> per-example outputs``.
MapFn: TypeAlias = Callable[[Any, Any], Any]
# The mesh axes a batch is split over, as collectives take them: one name,
# or a tuple of names for several axes.
AxisName: TypeAlias = str | tuple[str, ...]
# Each batch leaf's shape per example (without the leading examples axis),
# in the order of the leaves' names: what `Strategy.batch_leaf_shardings`
# lays out.
ExampleShapes: TypeAlias = Sequence[tuple[int, ...]]


class MeshSettings(NamedTuple):
    """How a strategy lays a step out on the named mesh ``("data", "fsdp",
    "context", "tensor")``, apart from how its devices are split over
    ``data``, ``fsdp`` and ``tensor``: what `Strategy.mesh_settings`
    declares. Each field is as `phalanx.MeshStrategy` takes it.

    Attributes:
        rules: the sharding rules, ``(pattern, spec)`` pairs.
        min_size: the least elements a floating leaf has to be split over
            ``fsdp``.
        context: the size of the ``context`` axis.
        sequence_dims: which dimension of which batch leaf ``context``
            splits (``{}``: none).
        offload: whether the optimizer state is kept in host memory.
    """

    rules: tuple[Rule, ...]
    min_size: int
    context: int
    sequence_dims: Mapping[str, int] | int
    offload: bool


class Strategy(eqx.Module):
    """How one training step runs across devices.

    A strategy answers three questions, and everything else in phalanx (the
    trainer, the compiled steps, prefetching, checkpoints, `save_model`)
    respects its answers and never asks which strategy it holds:

    - how state is laid out: `state_shardings`;
    - how a batch is split: `batch_sharding` and `batch_multiple` (the
      padding of a step, and each process's share of it, derive from the
      batch sharding: over which mesh axes the examples axis is split);
    - how a slice's work becomes a global result, with exactly one
      cross-device reduction per update: `reduce` (and `map` for outputs).

    What a strategy can do beyond that it declares on itself
    (`per_device_reduce`); callers ask the declaration, never the class.

    The base class carries no behaviour. Concrete strategies:
    [`phalanx.ShardingStrategy`][], [`phalanx.PmapStrategy`][],
    [`phalanx.FullyShardedStrategy`][], [`phalanx.MeshStrategy`][] and
    [`phalanx.AccumulatingStrategy`][]; phalanx lists them once, in its
    strategy registry (``strategies/_registry.py``), which the command
    line, `phalanx.testing.assert_equivalent`'s default set-ups and the
    tests read. A new one implements the abstract members below, or, on a
    named device mesh, the fewer ones of
    [`phalanx.strategies.DeviceMeshStrategy`][] (see
    ``docs/architecture.md``).
    """

    mesh: eqx.AbstractVar[Mesh]
    # The mesh axes batches are split over, as collectives in user code take
    # them (``jax.lax.psum(x, strategy.axis_name)``): one name for one axis,
    # a tuple of names for several.
    axis_name: eqx.AbstractVar[AxisName]

    @property
    @abc.abstractmethod
    def num_devices(self) -> int:
        """How many devices a step runs on."""

    @property
    @abc.abstractmethod
    def batch_sharding(self) -> Sharding:
        """Where a batch's leaves go: split along their leading examples axis."""

    def batch_leaf_shardings(
        self, names: Sequence[str], shapes: ExampleShapes, *, whole: bool = True
    ) -> list[Sharding]:
        """Where each leaf of a batch goes, given its name in ``(x, y)``
        (``"x"``, ``"y"``, ``"x.tokens"``, ``"y.1"``: the path from the
        inputs or targets, keys joined by dots) and its shape per example
        (without the leading examples axis). `whole`: the names are a whole
        training batch's (False: `predict`'s inputs alone).

        The default: `batch_sharding` for every leaf. A strategy that also
        splits a dimension of each example (`MeshStrategy`'s ``context``
        axis splits sequences) lays the leaves out one by one; every layout
        still splits the examples axis as `batch_sharding` does.

        Raises:
            ValueError: the strategy's own per-leaf settings do not fit the
                batch (named before anything is placed).
        """
        del shapes, whole
        return [self.batch_sharding] * len(names)

    @property
    @abc.abstractmethod
    def batch_multiple(self) -> int:
        """A step's global batch is padded to a multiple of this (for an even
        split over the batch's slices, and the microbatches of each)."""

    @abc.abstractmethod
    def state_shardings(self, state: PyTree[Any]) -> PyTree[Sharding]:
        """Where each array of the training state lives.

        Args:
            state: the `TrainState` with a `jax.ShapeDtypeStruct` in place
                of each array (select by position, e.g. ``state.opt_state``).

        Returns:
            A pytree of the same structure as `state`'s arrays: one
            `jax.sharding.Sharding` on `mesh` per array. The trainer places
            the state there, compiles its steps to keep it there, and
            restores checkpoints there.
        """

    def gradient_shardings(self, params: PyTree[Any]) -> PyTree[Sharding] | None:
        """Where the reduced gradient is laid out, given `params`: the model
        with each parameter's `Sharding` in place of its array.

        None (the default): where `reduce` leaves it (a per-device strategy
        places it itself). A global-view strategy whose compiler might keep
        a gradient split where its parameter is whole returns `params`.
        """
        del params
        return None

    def use_shardings(self, params: PyTree[Any]) -> PyTree[Sharding] | None:
        """Where the step uses each parameter, given `params`: the model with
        each parameter's `Sharding` (where it is stored) in place of its
        array.

        None (the default): where it is stored, or where `reduce` gathers
        it. A global-view strategy that stores parameters split over an
        axis the batch is split over may return them gathered over it, so
        that the compiler computes with them as it would with parameters
        stored so.
        """
        del params
        return None

    @abc.abstractmethod
    def reduce(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        """Sum `fn` over every example of the global batch.

        Called inside `jax.jit`. The result must equal ``fn`` applied to the
        whole batch on one device, up to float summation order, and must cost
        exactly one cross-device reduction.

        Args:
            fn: the work of one slice, ``fn(replicated, carry, examples) ->
                (sums, carry)``.
            replicated: arrays every slice uses in full (parameters, keys).
            carry: model state threaded through the step; every device
                returns the same value (float state is averaged over devices).
            examples: a pytree of arrays sharing the leading examples axis.

        Returns:
            ``(sums, carry)``, the same on every device.
        """

    @abc.abstractmethod
    def map(self, fn: MapFn, replicated: PyTree, examples: PyTree) -> PyTree:
        """Apply `fn` to every example; outputs stay split as the batch is."""

    def split_min_size(self) -> int | None:
        """The least elements a floating state leaf has for this strategy to
        split it (its ``min_size``), read by the layout lint; None (the
        default): the strategy splits no state by size."""
        return None

    def mesh_settings(self) -> MeshSettings | None:
        """The capability to lay a step out on the named mesh of
        `phalanx.MeshStrategy`: the settings that hold whichever way the
        devices are split over its axes (rules, ``min_size``, the
        ``context`` axis and its sequences, offload).

        None (the default): the strategy has no such settings. The planner
        (`px.plan`, `DataParallelTrainer.plan`) weighs the mesh splits of a
        strategy that declares them, keeping them in every layout of its
        default `px.PlanSpace` (it weighs offload itself), and plans one
        that declares none as it is (its microbatches and remat); the
        strategy's name shows the offload. A wrapper answers for the
        strategy it wraps. Callers ask this method, never the class.
        """
        return None

    def per_device_reduce(self) -> Reduce | None:
        """The capability to run a slice's work as a per-device program: a
        function with `reduce`'s signature and contract (the sums of the
        whole batch, one cross-device reduction) in which `fn` runs on each
        device's slice, its replicated inputs device-varying, so that the
        gradients taken inside `fn` are that device's own and cross devices
        only after `fn` returns.

        None (the default): the strategy has only its `reduce`. A strategy
        that declares the capability (every `PerDeviceStrategy`) can be
        wrapped by [`phalanx.AccumulatingStrategy`][], which scans each
        device's microbatches inside `fn` and so reduces once per update;
        under a mixed `precision` policy the step reduces with it, so that
        the gradients cross devices in the policy's `reduce` dtype. Callers
        ask this method, never the strategy's class.
        """
        return None


class PerDeviceStrategy(Strategy):
    """A strategy that can also run a slice's work as a per-device program:
    it declares the capability (`per_device_reduce`) by implementing
    `reduce_per_device`.

    [`phalanx.AccumulatingStrategy`][] wraps one of these: it scans each
    device's microbatches inside `fn`, and the wrapped strategy adds up the
    devices' sums once afterwards.
    """

    @override
    def per_device_reduce(self) -> Reduce:
        return self.reduce_per_device

    @abc.abstractmethod
    def reduce_per_device(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        """As `reduce`, but `fn` always runs as a per-device program.

        Inside `fn` the replicated inputs are device-varying, so gradients
        taken there are this device's own; the one reduction happens after
        `fn` returns.
        """
