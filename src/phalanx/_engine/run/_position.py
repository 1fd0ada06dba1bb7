"""Where a fit's data stands (`DataPosition`): the loop notes the pass it
trains on, and a snapshot taken during the fit reads the training data's
and the evaluation sets' positions here. Nothing here reads a batch or
moves a loader; it only asks where they stand.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from ..._typing import EvalSets
from ...checkpoint._agreement import PER_PROCESS, every_process
from ...checkpoint._resume import eval_positions
from ...data import Resumable
from ...data._grain_iterables import GrainIterable
from ..feed._feed import Feed


class DataPosition:
    """The position of a fit's data, for a snapshot: the pass's note of it
    while batches are read ahead, else the loaders' own."""

    def __init__(self, data: Any, eval_sets: EvalSets | None):
        """Args:
        data: the training data (its position is a snapshot's, between
            passes).
        eval_sets: the fit's evaluation sets (their positions too; None:
            none).
        """
        self._data = data
        self._eval_sets = eval_sets
        self._feed: Feed | None = None

    @contextlib.contextmanager
    def reading(self, feed: Feed) -> Iterator[None]:
        """The pass `feed` is trained on, while the block runs."""
        self._feed = feed
        try:
            yield
        finally:
            self._feed = None

    def data_state(self) -> Any:
        """Where the training data stands after the last batch trained on:
        the pass's note of it while batches are read ahead, else the
        loader's own state (None for data that is not `Resumable`)."""
        feed, data = self._feed, self._data
        if feed is not None and feed.tracking:
            state = feed.state
        elif isinstance(data, Resumable):
            state = data.state_dict()
        else:
            return None
        if isinstance(data, GrainIterable) and jax.process_count() > 1:
            # Each process's own position (a grain iterator's in its shard),
            # gathered: every process snapshots at the same step.
            return {PER_PROCESS: every_process(state)}
        return state

    def eval_states(self) -> dict[str, Any]:
        """Where each `Resumable` evaluation set stands, by its prefix (a
        snapshot's ``eval_data``)."""
        return eval_positions(self._eval_sets)
