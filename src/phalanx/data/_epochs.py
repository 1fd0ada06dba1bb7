"""`EpochCursor`: where a loader's iteration stands, shared by `ArrayLoader`
and `GrainLoader`: the epoch, the batches already yielded in it, and the
``{"epoch", "position", "batch_size"}`` state a checkpoint keeps (NumPy
only). The position counts batches of the batch size it was saved with, so
a loader of another batch size refuses it (as ``phalanx train --resume``
refuses another ``--batch-size``) instead of skipping or repeating
examples. `EpochLoader`: what both loaders build on it (their length, epoch
and position; their iteration is `EpochCursor.rest_of_epoch` over their own
reads)."""

import abc
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, final

from .._validate import integer


_Batch = TypeVar("_Batch")


@final
class EpochCursor:
    """The epoch and position of a loader of `batches` batches an epoch.

    A loader yields the batch at `position`, then calls `advance` before
    handing it on: a consumer that stops after a batch has used it, and the
    state is then already where to resume.
    """

    def __init__(self, examples: int, batch_size: int, drop_last: bool):
        """
        Raises:
            ValueError: ``drop_last=True`` leaves no batches.
        """
        self.batches = (
            examples // batch_size if drop_last else -(-examples // batch_size)
        )
        self.batch_size = batch_size
        if self.batches == 0:
            raise ValueError(
                f"drop_last=True with {batch_size=} > {examples} examples "
                "leaves no batches; use a smaller batch_size or drop_last=False"
            )
        self.epoch = 0
        self.position = 0

    @property
    def index(self) -> int:
        """The next batch, counted across epochs."""
        return self.epoch * self.batches + self.position

    def advance(self) -> None:
        """Past one batch: to the next position, or the next epoch's first."""
        self.position += 1
        if self.position == self.batches:
            self.epoch, self.position = self.epoch + 1, 0

    def rest_of_epoch(self, read: Callable[[], _Batch]) -> Iterator[_Batch]:
        """`read()` at each position left in the current epoch, the cursor
        advanced past each batch before it is yielded; then at the next
        epoch."""
        epoch = self.epoch
        while self.epoch == epoch:
            batch = read()
            self.advance()
            yield batch

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": ..., "position": ..., "batch_size": ...}``."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "batch_size": int(self.batch_size),
        }

    def load_state_dict(self, state_dict: Any, loader: str, made_of: str) -> None:
        """Go back to `state_dict`, checked: `loader` names the class whose
        `state_dict` makes it, `made_of` what it reads (for the message).

        Raises:
            TypeError, ValueError: `state_dict` is not one such a loader made,
                or one of another batch size; nothing changes then.
        """
        keys = set(state_dict) if isinstance(state_dict, Mapping) else set()
        # (A state saved before the batch size was kept has none.)
        if keys not in ({"epoch", "position", "batch_size"}, {"epoch", "position"}):
            raise ValueError(
                f"state_dict={state_dict!r} must be a dict with exactly the keys "
                f"'epoch', 'position' and 'batch_size', as returned by "
                f"{loader}.state_dict()"
            )
        epoch, position = state_dict["epoch"], state_dict["position"]
        integer("state_dict['epoch']", epoch, minimum=0, numpy=True, example="0")
        integer("state_dict['position']", position, minimum=0, numpy=True, example="0")
        saved = state_dict.get("batch_size", self.batch_size)
        integer("state_dict['batch_size']", saved, minimum=1, numpy=True, example="1")
        if saved != self.batch_size:
            what = (
                "it would skip or repeat examples of the epoch"
                if position
                else "its batches would be another run's"
            )
            raise ValueError(
                f"{loader}'s batch_size={self.batch_size} differs from the "
                f"batch_size={saved} its state was saved with (position "
                f"{position} of epoch {epoch}, in batches of {saved}): resumed, "
                f"{what}; build the {loader} with batch_size={saved} to continue "
                "the run, or start a new run without resume"
            )
        if position >= self.batches:
            raise ValueError(
                f"state_dict['position']={position} is past the {self.batches} "
                "batches of an epoch of this loader; load a state saved from a "
                f"loader with the same {made_of}, batch_size and drop_last"
            )
        # Python ints (NumPy ints pass the checks): the state goes to JSON.
        self.epoch, self.position = int(epoch), int(position)


class EpochLoader(abc.ABC):
    """A loader that yields its batches an epoch at a time from where its
    `EpochCursor` stands: `ArrayLoader` and `GrainLoader` (each final), which
    set `_at` when built and iterate with `EpochCursor.rest_of_epoch`."""

    _at: EpochCursor

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Any]:
        """Yield the rest of the current epoch, then move to the next epoch."""

    def __len__(self) -> int:
        """Batches per epoch."""
        return self._at.batches

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0 first)."""
        return self._at.epoch

    @property
    def position(self) -> int:
        """Batches already yielded in the current epoch."""
        return self._at.position
