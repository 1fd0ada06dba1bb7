"""From a host batch to a device batch: check, pad, place.

The pipeline never calls the trainer and never compiles: it splits a
batch into ``(inputs, targets, sample_weight)`` with the trainer's host
hooks, and checks every batch against the spec of the programs built from
the first (`Programs.first`). Everything it remembers (signatures checked,
weights and totals placed, batches prepared before) is in bounded `Memo`s.
It runs on the calling thread or on the feed's background thread; it never
calls the loop or the callbacks."""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..._checks._hooks import check_split
from ..._checks._run_errors import zero_weight_message
from ...strategies import Strategy
from ...strategies._placement import (
    local_rows,
    put_batch,
    replicated,
    replicated_float32,
    single_process,
)
from ..program._programs import Programs
from ..program._spec import BatchSpec, Leaf, Signature, signature
from ._batch_checks import (
    batch_leaf_names,
    check_batch_layout,
    check_finite,
    check_sample_weight,
    flatten_batch,
    layout_check,
    num_examples,
)
from ._device_batch import DeviceBatch, FirstBatch, pad, quick_key
from ._labels import check_class_labels, check_labels
from ._memo import Memo
from ._processes import check_same_slices
from ._stacking import BatchStacker


class HostHooks(NamedTuple):
    """The trainer's hooks that run on the host, per batch.

    Attributes:
        split_batch: ``split_batch(batch) -> (inputs, targets)``.
        sample_weight: ``sample_weight(batch) -> weights | None``.
    """

    split_batch: Callable[[Any], Any]
    sample_weight: Callable[[Any], Any]


class BatchPipeline:
    """Turns the user's host batches into padded, sharded device batches.

    A batch is split into ``(inputs, targets, sample_weight)`` by the
    trainer's `hooks`; the device batch is ``(inputs, targets)`` and the
    sample weights are folded into the step's per-example weights. The
    first batch ever is looked at by `first_batch` (the programs are built
    from it); every later one is checked against the spec of the programs
    built (with `class_labels`, the labels against the number of classes,
    the last axis of the model's outputs). Structure and shape checks then
    run once per new shape/dtype signature; value checks (finite floats,
    class labels in range, weights) on every NumPy batch when
    `value_checks` is on. A batch shorter than the step's size is padded
    with zero-weight examples, so the update is exact. The total weight is
    summed on the host where it holds every weight (one process, host
    weights), and on the devices otherwise.

    Attributes:
        batch_names: the first batch's leaves (of ``(inputs, targets)``)
            named by their paths in the user's batch (None before any).
        size: the global step size of the latest training pass (its first
            batch's; None before any).
    """

    def __init__(
        self,
        strategy: Strategy,
        hooks: HostHooks,
        programs: Programs,
        *,
        value_checks: bool,
        class_labels: bool,
    ):
        self.strategy = strategy
        self.hooks = hooks
        self._programs = programs
        # This process's slice of a step is padded to a multiple of this: the
        # rows of one batch multiple its devices hold under the batch sharding.
        self._multiple = local_rows(strategy.batch_sharding, strategy.batch_multiple)
        # The global step is this many times this process's slice.
        self._processes = strategy.batch_multiple // self._multiple
        self.value_checks = value_checks
        self.class_labels = class_labels
        self.batch_names: list[str] | None = None
        self.size: int | None = None
        # The first batch, split: preparing it next splits it once (the
        # user's hooks run once per batch).
        self._first: tuple[Any, tuple[Any, Any, Any]] | None = None
        # Examples in a batch of each signature checked before.
        self._sizes: Memo[Signature, int] = Memo()
        self._weights: Memo[tuple[int, int], jax.Array] = Memo()
        self._totals: Memo[float, jax.Array] = Memo()
        self._split = strategy.batch_sharding  # the weights'
        # Each leaf's layout (`Strategy.batch_leaf_shardings`), from the first
        # batch: every later one has its structure and shapes per example.
        self.splits: list[Any] = []
        self._mesh = strategy.mesh
        self._replicated = replicated(self._mesh)
        self._device_total = jax.jit(jnp.sum, out_shardings=self._replicated)
        # Several steps' batches, stacked for one call (it knows the cached
        # weights by `_weights`).
        self._stacker = BatchStacker(self._mesh, self._split, self._weights)
        # Batches prepared before, less their leaves, by `quick_key`.
        self._quick: Memo[Any, tuple[Any, ...]] = Memo()

    def split(self, batch: Any) -> tuple[Any, Any, Any]:
        """``(inputs, targets, sample_weight)`` of a user's batch."""
        inputs, targets = self.inputs_and_targets(batch)
        return inputs, targets, self.hooks.sample_weight(batch)

    def inputs_and_targets(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, targets)`` of a user's batch (or of its shapes)."""
        return check_split(self.hooks.split_batch(batch))

    def first_batch(self, batch: Any, where: str) -> FirstBatch:
        """The first batch ever: its spec and global step size, for the
        programs to be built from; every later batch is checked against the
        spec of the programs built."""
        parts = self.split(batch)
        leaves, treedef = flatten_batch(parts[:2], where)
        n = num_examples(leaves, treedef, where)
        spec = BatchSpec.of(leaves, treedef)
        self.splits = spec.shardings(self.strategy)
        check_batch_layout(leaves, treedef, self.splits, where)
        labels = jax.tree.unflatten(treedef, leaves)[1]
        if self.class_labels:
            check_class_labels(labels)
        if self.batch_names is None:
            self.batch_names = batch_leaf_names(batch, *parts[:2])
        self._first = (batch, parts)
        # The spec's own batch: checked.
        self._sizes.remember(signature(leaves, treedef), n)
        # The step sees the global batch: every process's slice.
        size = self.step_size(n, None) * self._processes
        return FirstBatch(spec, size, labels)

    def prepare(
        self, batch: Any, where: str, first: int | None, *, train: bool = False
    ) -> DeviceBatch:
        """A user's `batch` checked, padded and placed (see `placed`), once
        a program has fixed the batches' spec."""
        built, self._first = self._first, None
        if built is not None and built[0] is batch:
            parts = built[1]  # split when its program was built
        else:
            parts = self.split(batch)
        prepared = self.placed(parts, where, first, train=train)
        if train and self.size != (size := prepared.size if first is None else first):
            # A pass's first batch fixes its step size; a pass resumed in its
            # middle keeps the size it had (`first`), which a new process
            # learns here (else its FLOPs, and Throughput's, would be
            # unknown until the next pass).
            self.size = size
        return prepared

    def size_of(self, batch: Any, where: str) -> int:
        """The global step size of a user's `batch`, checked against the
        batches' spec (a program is built first); nothing is placed."""
        parts = self.split(batch)
        _, _, n, _ = self.check(parts, (*jax.tree.flatten(parts[:2]), None), where)
        return self.step_size(n, None) * self._processes

    def stack(self, group: list[DeviceBatch]) -> tuple[list[Any], Any, jax.Array]:
        """The batches of `group` stacked for one call of several steps."""
        return self._stacker.stack(group, self.splits)

    def step_size(self, n: int, first: int | None) -> int:
        """Examples in the padded step: the pass's first size, or n if larger."""
        multiple = self._multiple
        return math.ceil(max(n, first or 0) / multiple) * multiple

    def check(
        self,
        parts: tuple[Any, Any, Any],
        flat: tuple[list[Any], Any, Signature | None],
        where: str,
    ) -> tuple[list[Leaf], Any, int, np.ndarray | None]:
        """Check a batch's ``(inputs, targets, sample_weight)``, given the
        leaves and structure of ``(inputs, targets)`` and their `signature`
        (None where some leaf is not an array).

        Returns:
            The leaves (as arrays) and structure of ``(inputs, targets)``, the
            number of examples, and the sample weights (or None).
        """
        inputs, targets, sample_weight = parts
        leaves, treedef, quick = flat
        # A signature seen before: its leaves were arrays, checked then.
        n = None if quick is None else self._sizes.get(quick)
        if n is None:
            leaves, treedef = flatten_batch((inputs, targets), where)
            key = signature(leaves, treedef)
            n = num_examples(leaves, treedef, where)
            program = self._programs.first
            assert program is not None, "a program is built before a batch"
            program.spec.check(leaves, treedef, where)
            self._sizes.remember(key, n)
        if sample_weight is not None:
            sample_weight = check_sample_weight(sample_weight, n, where)
        host = [leaf for leaf in leaves if isinstance(leaf, np.ndarray)]
        if self.value_checks and len(host) == len(leaves):
            check_finite(host, treedef, where)
            program = self._programs.first
            if self.class_labels and program is not None:
                labels = jax.tree.unflatten(treedef, host)[1]
                check_labels(labels, int(program.outputs.shape[-1]), where)
        return leaves, treedef, n, sample_weight

    def placed(
        self,
        parts: tuple[Any, Any, Any],
        where: str,
        first: int | None,
        *,
        train: bool = False,
    ) -> DeviceBatch:
        """Check, pad and shard one batch, split as ``(inputs, targets,
        sample_weight)`` (`first`: the pass's step size, None at its first
        batch). A batch to `train` on must weigh something: its gradient is
        divided by its total weight.

        A batch like one seen before at this point of a pass (leaves of the
        same shapes, dtypes and layouts) whose leaves were used as they are
        (laid out as the strategy splits them, or host leaves of one process
        with value checks off) and needed no padding takes a quick path:
        nothing is checked or placed again; its cached weights and total."""
        leaves, treedef = jax.tree.flatten(parts[:2])
        key = None
        if parts[2] is None:
            key = quick_key(leaves, treedef, first, train)
            quick = self._quick.get(key)
            if quick is not None:
                return DeviceBatch(leaves, *quick)
        arrays = all(isinstance(leaf, Leaf) for leaf in leaves)
        flat = (leaves, treedef, signature(leaves, treedef) if arrays else None)
        leaves, treedef, n, sample_weight = self.check(parts, flat, where)
        if first is None:  # a pass's first batch fixes its step's shape
            check_same_slices(leaves, treedef, where)
        elif n > first and not single_process():
            raise ValueError(
                f"data: {where} has {n} examples on process {jax.process_index()}, "
                f"more than the pass's first batch ({first}); in a multi-process "
                "run the first batch of a pass must be the largest"
            )
        size = self.step_size(n, first)
        if sample_weight is not None and (sample_weight == 1).all():
            sample_weight = None  # e.g. a loader's full batch: cached weights
        if (
            train
            and sample_weight is not None
            and not sample_weight.any()
            and single_process()  # else a slice; the devices see it all
        ):
            raise ValueError(zero_weight_message(where))
        placed = self.place(pad(leaves, size), treedef, where if n == size else None)
        # Weights are always on the devices: cached ones without sample
        # weights (nothing to transfer), placed ones with (a step given NumPy
        # weights here and device weights there would compile twice).
        if sample_weight is None:
            weight = self.weights(n, size)
            total, value = self.total(weight, n)  # n ones
        else:
            (weight,) = put_batch(pad([sample_weight], size), self._split)
            total, value = self.total(weight, sample_weight)
        prepared = DeviceBatch(placed, weight, total, size, n, value)
        on_host = any(isinstance(x, np.ndarray) for x in placed)
        if (
            sample_weight is None
            and n == size
            and value is not None  # one process
            and not (on_host and self.value_checks)  # values checked each time
            and key is not None
            and all(x is y for x, y in zip(placed, leaves, strict=True))  # unmoved
        ):
            self._quick.remember(key, prepared[1:])
        return prepared

    def place(
        self, leaves: list[Leaf], treedef: Any, where: str | None
    ) -> list[jax.Array | np.ndarray]:
        """Leaves for a step: NumPy leaves of a single process as they are
        (the compiled step's input shardings split them across the devices
        as it is called, in C++: cheaper than a `jax.device_put` first),
        anything else placed by the strategy; leaves the user placed in another
        layout refused where they would move (`where`: None for a batch padded
        here, a new array: not checked)."""
        if single_process() and all(isinstance(x, np.ndarray) for x in leaves):
            return [*leaves]
        check = layout_check(treedef, self.splits, where)
        return [*put_batch(leaves, self.splits, before_move=check)]

    def weights(self, n: int, size: int) -> jax.Array:
        """Device weights for n real examples padded to size (cached)."""

        def make() -> jax.Array:
            host = np.zeros(size, np.float32)
            host[:n] = 1.0
            return put_batch([host], self._split)[0]

        return self._weights.get_or_make((n, size), make)

    def total(
        self, weight: jax.Array, host: np.ndarray | int
    ) -> tuple[jax.Array, float | None]:
        """Σ of the global batch's weights, replicated (`host`: this
        process's weights, or their sum), and its value where the host knows
        it (one process)."""
        if not single_process():
            # Only the devices see every process's weights. Every process
            # runs this reduction for every batch (never cached: the
            # processes must run the same collectives in the same order).
            return self._device_total(weight), None
        value = float(host if isinstance(host, int) else np.sum(host, dtype=np.float64))
        total = self._totals.get_or_make(  # e.g. every batch size of a pass
            value, lambda: replicated_float32(value, self._mesh)
        )
        return total, value
