"""From a host batch to a device batch: check, pad, place."""

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._checks._batch import (
    BatchSpec,
    Leaf,
    Signature,
    check_class_labels,
    check_finite,
    check_labels,
    check_sample_weight,
    flatten_batch,
    label_shape_hint,
    num_examples,
    signature,
    zero_weight_message,
)
from .._checks._hooks import HookError
from ..strategies import Strategy
from ..strategies._placement import (
    local_share,
    put_batch,
    replicated,
    single_process,
    stacked,
)
from ._processes import check_same_slices


class DeviceBatch(NamedTuple):
    """A batch ready for a step.

    Attributes:
        leaves: the leaves of ``(inputs, targets)``: split across devices, or
            NumPy arrays the step itself places (single process).
        weight: per-example weights (sample weights; 0 for padding), split
            across devices.
        total: Σ weight over the global batch, replicated.
        size: examples in the padded step; pass it back as `first` for the
            rest of the pass.
        n: this process's real examples.
        total_value: `total` on the host, where known (one process).
    """

    leaves: list[jax.Array | np.ndarray]
    weight: jax.Array
    total: jax.Array
    size: int
    n: int
    total_value: float | None = None


class BatchPipeline:
    """Turns the user's host batches into padded, sharded device batches.

    `split` turns a user batch into ``(inputs, targets, sample_weight)`` on
    the host; the device batch is ``(inputs, targets)`` and the sample weights
    are folded into the step's per-example weights. Structure and shape
    checks run once per new shape/dtype signature; the first batch ever seen
    fixes the `BatchSpec`, and `validate(spec, size)` checks it against the
    model and loss at a step of `size` examples (returning the outputs'
    shape: with `class_labels`, its last axis is the number of classes).
    Value checks (finite floats, class labels in range, weights) run on
    every NumPy batch when `value_checks` is on. A batch shorter than the step's
    size is padded with zero-weight examples, so the update is exact. The
    total weight is summed on the host where it holds every weight (one
    process, host weights), and on the devices otherwise.
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        split: Callable[[Any], tuple[Any, Any, Any]],
        value_checks: bool,
        class_labels: bool,
        validate: Callable[[BatchSpec, int], jax.ShapeDtypeStruct],
    ):
        self.strategy = strategy
        # This process's slice of a step is padded to a multiple of this: its
        # devices in the mesh × the examples each device takes per multiple.
        per_device = strategy.batch_multiple // strategy.num_devices
        self._multiple = local_share(strategy.mesh) * per_device
        # The global step is this many times this process's slice.
        self._processes = strategy.batch_multiple // self._multiple
        self.split = split
        self.value_checks = value_checks
        self.class_labels = class_labels
        self.validate = validate
        self.spec: BatchSpec | None = None
        self.num_classes: int | None = None
        self._sizes: dict[Any, int] = {}
        self._weights: dict[tuple[int, int], jax.Array] = {}
        self._totals: dict[float, jax.Array] = {}
        self._split = strategy.batch_sharding
        self._replicated = replicated(strategy.mesh)
        self._device_total = jax.jit(jnp.sum, out_shardings=self._replicated)
        # Stacked weights (by batch count, size and steps) and totals (by
        # value), for several steps' batches.
        self._stacked_weights: dict[tuple[int, int, int], jax.Array] = {}
        self._stacked_totals: dict[tuple[float | None, ...], jax.Array] = {}
        # Batches prepared before, less their leaves, by `_quick_key`.
        self._quick: dict[Any, DeviceBatch] = {}

    @functools.cached_property
    def _stack_on_devices(self) -> Any:
        """Stacks each list of arrays along a new leading (steps) axis, on
        the devices, split as a stacked batch."""
        steps = stacked(self.strategy.batch_sharding)
        return jax.jit(lambda xs: [jnp.stack(x) for x in xs], out_shardings=steps)

    @functools.cached_property
    def _stack_totals(self) -> Any:
        return jax.jit(jnp.stack, out_shardings=self._replicated)

    def _stack_leaves(self, columns: list[list[Any]]) -> list[Any]:
        """Each column of arrays stacked along a new leading (steps) axis: on
        the host where all are host arrays of one process, else on the
        devices."""
        if single_process() and all(
            isinstance(x, np.ndarray) for column in columns for x in column
        ):
            return [np.stack(column) for column in columns]
        return self._stack_on_devices(columns)

    def stack(self, group: list[DeviceBatch]) -> tuple[list[Any], Any, jax.Array]:
        """The leaves, weights and totals of several steps' batches (of one
        step size), each stacked along a new leading (steps) axis: the
        arguments of one compiled call of several steps. Host leaves are
        stacked on the host (one transfer each), device leaves on the
        devices; the weights and totals of batches without sample weights
        are cached."""
        first = group[0]
        leaves = self._stack_leaves(
            [[batch.leaves[i] for batch in group] for i in range(len(first.leaves))]
        )
        weights = [batch.weight for batch in group]
        cached = self._weights.get((first.n, first.size))
        key = (first.n, first.size, len(group))
        if all(w is cached for w in weights):  # the cached ones
            weight = self._stacked_weights.get(key)
            if weight is None:
                weight = self._stack_leaves([weights])[0]
                if len(self._stacked_weights) < 64:
                    self._stacked_weights[key] = weight
        else:
            weight = self._stack_leaves([weights])[0]
        values = tuple(batch.total_value for batch in group)
        total = self._stacked_totals.get(values)
        if total is None:
            if all(value is not None for value in values):
                host = np.array(values, np.float32)
                total = jax.device_put(host, self._replicated)
                if len(self._stacked_totals) < 64:
                    self._stacked_totals[values] = total
            else:
                total = self._stack_totals([batch.total for batch in group])
        return leaves, weight, total

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
        leaves and structure of ``(inputs, targets)`` and their
        `_quick_signature`.

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
            if self.spec is None:
                spec = BatchSpec.of(leaves, treedef)
                self._first_spec(spec, leaves)
                self.spec = spec
            else:
                self.spec.check(leaves, treedef, where)
            self._sizes[key] = n
        if sample_weight is not None:
            sample_weight = check_sample_weight(sample_weight, n, where)
        host = [leaf for leaf in leaves if isinstance(leaf, np.ndarray)]
        if self.value_checks and len(host) == len(leaves):
            check_finite(host, treedef, where)
            if self.class_labels and self.num_classes is not None:
                labels = jax.tree.unflatten(treedef, host)[1]
                check_labels(labels, self.num_classes, where)
        return leaves, treedef, n, sample_weight

    def _first_spec(self, spec: BatchSpec, leaves: list[Leaf]) -> None:
        """Validate the first batch against the model and loss."""
        labels = jax.tree.unflatten(spec.treedef, leaves)[1]
        if self.class_labels:
            check_class_labels(labels)
        # The step sees the global batch: every process's slice.
        size = self.step_size(leaves[0].shape[0], None) * self._processes
        try:
            outputs = self.validate(spec, size)
        except HookError:
            raise  # a hook's own fault, named by its message
        except (TypeError, ValueError) as error:
            hint = label_shape_hint(labels) if self.class_labels else None
            if hint is None:
                raise
            raise TypeError(hint) from error
        if self.class_labels:
            self.num_classes = int(outputs.shape[-1])

    def prepare(
        self, batch: Any, where: str, first: int | None, *, train: bool = False
    ) -> DeviceBatch:
        """Check, pad and shard one batch (`first`: the pass's step size, None
        at its first batch). A batch to `train` on must weigh something: its
        gradient is divided by its total weight.

        A batch like one seen before at this point of a pass, whose leaves
        are all on the devices (or, with value checks off, all on the host)
        and need no padding, takes a quick path: its signature is looked up
        and its cached weights and total reused."""
        parts = self.split(batch)
        leaves, treedef = jax.tree.flatten(parts[:2])
        quick_signature = _quick_signature(leaves, treedef)
        key = None
        if parts[2] is None and quick_signature is not None:
            key = (quick_signature, first, train)
            quick = self._quick.get(key)
            if quick is not None:
                return quick._replace(leaves=self.place(leaves))
        flat = (leaves, treedef, quick_signature)
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
        placed = self.place(pad(leaves, size))
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
            and len(self._quick) < 64
        ):
            self._quick[key] = prepared._replace(leaves=[])
        return prepared

    def place(self, leaves: list[Leaf]) -> list[jax.Array | np.ndarray]:
        """Leaves for a step: NumPy leaves of a single process as they are
        (the compiled step's input shardings split them across the devices
        as it is called, in C++: cheaper than a `jax.device_put` first),
        anything else placed by the strategy."""
        if single_process() and all(isinstance(x, np.ndarray) for x in leaves):
            return [*leaves]
        return [*put_batch(leaves, self._split)]

    def weights(self, n: int, size: int) -> jax.Array:
        """Device weights for n real examples padded to size (cached)."""
        weight = self._weights.get((n, size))
        if weight is None:
            host = np.zeros(size, np.float32)
            host[:n] = 1.0
            weight = self._weights[(n, size)] = put_batch([host], self._split)[0]
        return weight

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
        total = self._totals.get(value)
        if total is None:
            total = jax.device_put(np.float32(value), self._replicated)
            if len(self._totals) < 64:  # e.g. every batch size of a pass
                self._totals[value] = total
        return total, value


def _quick_signature(leaves: list[Any], treedef: Any) -> Signature | None:
    """The `signature` of leaves that are all arrays (else None): the key of
    a batch's checks, made without converting or checking anything."""
    for leaf in leaves:
        if not isinstance(leaf, Leaf):
            return None
    return treedef, tuple([(leaf.shape, leaf.dtype) for leaf in leaves])


def pad(leaves: list[Leaf], size: int) -> list[Leaf]:
    """Pad every leaf with zeros along the leading axis to `size` examples
    (on the host, or on device for a `jax.Array`)."""
    return [
        leaf
        if leaf.shape[0] == size
        else (jnp if isinstance(leaf, jax.Array) else np).concatenate(
            [leaf, np.zeros((size - leaf.shape[0], *leaf.shape[1:]), leaf.dtype)]
        )
        for leaf in leaves
    ]
