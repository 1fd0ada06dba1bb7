"""A user's batch made ready for a step, and the program built for a batch.

`Preparer.prepare` is the one way a host batch reaches the devices (in
`fit`, `evaluate`, `compute_step` and `lower`): the trainer's host hooks
split it, the `BatchPipeline` checks, pads and places it. It never builds a
program: `Preparer.build` does, asked explicitly for the first batch (by the
loop before a pass's batches are prepared, or by `evaluate`, `summary`,
...), and a batch is prepared only once a program has fixed the batches'
spec. It runs on the calling thread or on the feed's background thread; it
never calls the loop or the callbacks.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from .._checks._batch import batch_leaf_names
from .._checks._hooks import HookError, check_split
from .._checks._labels import label_shape_hint
from ._compiled import StepCompiler
from ._device_batch import DeviceBatch
from ._pipeline import BatchPipeline
from ._program import Program


class HostHooks(NamedTuple):
    """The trainer's hooks that run on the host, per batch.

    Attributes:
        split_batch: ``split_batch(batch) -> (inputs, targets)``.
        sample_weight: ``sample_weight(batch) -> weights | None``.
    """

    split_batch: Callable[[Any], Any]
    sample_weight: Callable[[Any], Any]


class Preparer:
    """Host batches to device batches, and the program of a batch.

    Attributes:
        pipeline: checks, pads and places the split batches.
        compiler: builds the programs.
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
        self._stacker = pipeline.stacker
        self.size: int | None = None
        # The first batch's leaves by their paths in the user's batch, for
        # messages about the step's arguments (None before any batch).
        self.batch_names: list[str] | None = None
        # The batch a program was last built for, split: preparing it next
        # splits it once (the user's hooks run once per batch).
        self._built: tuple[Any, tuple[Any, Any, Any]] | None = None

    def split(self, batch: Any) -> tuple[Any, Any, Any]:
        """``(inputs, targets, sample_weight)`` of a user's batch."""
        inputs, targets = check_split(self.hooks.split_batch(batch))
        if self.batch_names is None:
            self.batch_names = batch_leaf_names(batch, inputs, targets)
        return inputs, targets, self.hooks.sample_weight(batch)

    def prepare(
        self, batch: Any, where: str, first: int | None, *, train: bool = False
    ) -> DeviceBatch:
        """`batch` checked, padded and placed (see `BatchPipeline.prepare`),
        once a program has fixed the batches' spec."""
        assert self.pipeline.spec is not None, "a program is built before a batch"
        built, self._built = self._built, None
        parts = (
            built[1] if built is not None and built[0] is batch else self.split(batch)
        )
        placed = self.pipeline.prepare(parts, where, first, train=train)
        if train and self.size != (size := placed.size if first is None else first):
            # A pass's first batch fixes its step size; a pass resumed in its
            # middle keeps the size it had (`first`), which a new process
            # learns here (else its FLOPs, and Throughput's, would be
            # unknown until the next pass).
            self.size = size
        return placed

    def build(self, batch: Any, where: str, *, compile: bool = True) -> Program:
        """The program for a user's first `batch`, checked against the model
        and loss abstractly: a batch that does not fit is refused before
        anything is placed or compiled; the batch's spec is every later
        batch's. (``compile=False``: see `build_program`.)"""
        parts = self.split(batch)
        first = self.pipeline.first_batch(parts, where)
        try:
            program = self.compiler.build(first.spec, first.size, compile=compile)
        except HookError:
            raise  # a hook's own fault, named by its message
        except (TypeError, ValueError) as error:
            hint = (
                label_shape_hint(first.labels) if self.pipeline.class_labels else None
            )
            if hint is None:
                raise
            raise TypeError(hint) from error
        self.pipeline.expect(first, program.outputs)
        self._built = (batch, parts)
        return program

    def size_of(self, batch: Any, where: str) -> int:
        """The global step size of a user's `batch`, checked against the
        batches' spec (a program is built first); nothing is placed."""
        parts = self.split(batch)
        self.pipeline.check(parts, (*jax.tree.flatten(parts[:2]), None), where)
        return self.pipeline.first_batch(parts, where).size

    def stack(self, group: list[DeviceBatch]) -> tuple[list[Any], Any, jax.Array]:
        """The batches of `group` stacked for one call of several steps."""
        return self._stacker.stack(group, self.pipeline.splits)

    def resized(self, program: Program, size: int) -> Program:
        """The program of `program`'s spec at a global step of `size`."""
        return self.compiler.build(program.spec, size)
