"""A user's batch made ready for a step, and the steps built for the first.

`Preparer.prepare` is the one way a host batch reaches the devices (in
`fit`, `evaluate`, `compute_step` and `lower`): the trainer's host hooks
split it, the `BatchPipeline` checks, pads and places it, and, at the first
batch ever, the `StepCompiler` is asked for the steps of its spec, once and
explicitly, before anything is placed. It runs on the calling thread or on
the feed's background thread; it never calls the loop or the callbacks.
It also counts the train step's FLOPs (`flops`), for a step size or for the
first batch's.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from .._checks._batch import batch_leaf_names, label_shape_hint
from .._checks._hooks import HookError, check_split
from .._state._sums import NO_FLAGS
from .._telemetry._flops import FlopCounter, StepFlops
from ._compiled import StepCompiler, Steps
from ._pipeline import BatchPipeline, DeviceBatch


class HostHooks(NamedTuple):
    """The trainer's hooks that run on the host, per batch.

    Attributes:
        split_batch: ``split_batch(batch) -> (inputs, targets)``.
        sample_weight: ``sample_weight(batch) -> weights | None``.
    """

    split_batch: Callable[[Any], Any]
    sample_weight: Callable[[Any], Any]


class Preparer:
    """Host batches to device batches, and the steps they run in.

    Attributes:
        pipeline: checks, pads and places the split batches.
        compiler: builds the steps for the first batch's spec.
        steps: the steps, once the first batch has been seen (None before).
        batch_names: the first batch's leaves (of ``(inputs, targets)``)
            named by their paths in the user's batch (None before any).
        size: the global step size of the latest training pass (its first
            batch's; None before any).
    """

    def __init__(
        self, hooks: HostHooks, pipeline: BatchPipeline, compiler: StepCompiler
    ):
        self.hooks = hooks
        self.pipeline = pipeline
        self.compiler = compiler
        self.steps: Steps | None = None
        self.size: int | None = None
        # The first batch's leaves by their paths in the user's batch, for
        # messages about the step's arguments (None before any batch).
        self.batch_names: list[str] | None = None
        self._flops = FlopCounter()

    def split(self, batch: Any) -> tuple[Any, Any, Any]:
        """``(inputs, targets, sample_weight)`` of a user's batch."""
        inputs, targets = check_split(self.hooks.split_batch(batch))
        if self.batch_names is None:
            self.batch_names = batch_leaf_names(batch, inputs, targets)
        return inputs, targets, self.hooks.sample_weight(batch)

    def prepare(
        self, batch: Any, where: str, first: int | None, *, train: bool = False
    ) -> DeviceBatch:
        """`batch` checked, padded and placed (see `BatchPipeline.prepare`);
        at the first batch ever, the steps are built for it first."""
        parts = self.split(batch)
        if self.steps is None:
            self.steps = self.build(parts, where)
        placed = self.pipeline.prepare(parts, where, first, train=train)
        if train and self.size != (size := placed.size if first is None else first):
            # A pass's first batch fixes its step size; a pass resumed in its
            # middle keeps the size it had (`first`), which a new process
            # learns here (else its FLOPs, and Throughput's, would be
            # unknown until the next pass).
            self.size = size
        return placed

    def build(self, parts: tuple[Any, Any, Any], where: str) -> Steps:
        """The steps for the first batch's spec, checked against the model and
        loss abstractly: a batch that does not fit is refused before anything
        is placed or compiled."""
        first = self.pipeline.first_batch(parts, where)
        try:
            steps = self.compiler.build(first.spec, first.size)
        except HookError:
            raise  # a hook's own fault, named by its message
        except (TypeError, ValueError) as error:
            hint = (
                label_shape_hint(first.labels) if self.pipeline.class_labels else None
            )
            if hint is None:
                raise
            raise TypeError(hint) from error
        self.pipeline.expect(first, steps.outputs)
        return steps

    def size_of(self, batch: Any, where: str) -> int:
        """The global step size of a user's `batch`, checked against the
        first batch's spec (at the first batch ever, the steps are built for
        it); nothing is placed."""
        parts = self.split(batch)
        if self.steps is None:
            self.steps = self.build(parts, where)
        self.pipeline.check(parts, (*jax.tree.flatten(parts[:2]), None), where)
        return self.pipeline.first_batch(parts, where).size

    def flops(self, size: int | None = None) -> StepFlops | None:
        """The train step's FLOPs at a global step of `size` examples (by
        default the latest training pass's); None without a size."""
        size = self.size if size is None else size
        if self.steps is None or size is None:
            return None
        spec = self.pipeline.spec
        assert spec is not None, "the steps are built for the first batch's spec"
        shapes = list(zip(spec.shapes, spec.dtypes, strict=True))
        steps, devices = self.steps, self.compiler.parts.strategy.num_devices
        return self._flops.count(
            size, devices, lambda: self._trace(steps, shapes, size)
        )

    def _trace(self, steps: Steps, shapes: list[Any], size: int) -> jex.Jaxpr:
        """`steps.train`'s jaxpr on abstract arguments of `size` examples
        whose leaves have these per-example `shapes` (``(shape, dtype)``
        pairs): `jax.jit`'s `trace`, the same trace a call makes (taken from
        JAX's cache where the step has run on a batch of that size), never
        compiled or run."""
        layout = self.compiler.layout
        state = [
            jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
            for s, sharding in zip(layout.structs, layout.shardings, strict=True)
        ]
        # A NumPy batch's leaves (as `fit` passes one process's host batches:
        # the trace JAX has cached); the count is the same for device leaves.
        batch = [jax.ShapeDtypeStruct((size, *shape), dtype) for shape, dtype in shapes]
        traced = steps.train.trace(
            state,
            jax.ShapeDtypeStruct((steps.sums.size,), jnp.float32),
            jax.ShapeDtypeStruct(NO_FLAGS.shape, NO_FLAGS.dtype),
            batch,
            jax.ShapeDtypeStruct((size,), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.float32),
        )
        return traced.jaxpr.jaxpr

    def built(self) -> Steps:
        """The steps, which a prepared batch has built."""
        assert self.steps is not None, "a batch is prepared before a step runs"
        return self.steps
