"""One plan's compiles, through the process' store of compiled train steps
(``_engine/program/_executables.py``): each candidate's step compiled
once a process (a later plan, or the fit of its choice, finds it), and
counted as compiled or reused."""

from collections.abc import Callable
from typing import Any

import jax

from .._engine.program import _executables as store


# JAX's event for a compile read from its persistent cache.
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_hits = [0]


def _count(event: str, **kwargs: Any) -> None:
    del kwargs
    if event == _CACHE_HIT:
        _hits[0] += 1


jax.monitoring.register_event_listener(_count)


class Compiles:
    """One plan's compiles through the process' store.

    Attributes:
        fresh: the programs it compiled.
        from_cache: of those, how many JAX read from its persistent
            compilation cache.
        reused: those it found compiled (by an earlier plan, or earlier in
            this one).
        keys: the store's keys of every program it compiled or found.
        last_key: the key of the last program it compiled or found.
        last_reused: whether that one was found.
    """

    def __init__(self) -> None:
        self.fresh = 0
        self.from_cache = 0
        self.reused = 0
        self.keys: set[tuple[Any, ...]] = set()
        self.last_key: tuple[Any, ...] | None = None
        self.last_reused = False

    def compile(
        self, lowered: jax.stages.Lowered, arguments: tuple[Any, ...]
    ) -> store.Kept:
        """`lowered` (a train call lowered for `arguments`) compiled, or
        found compiled in the store."""
        key = store.key_of(lowered, arguments)
        hits = _hits[0]
        found, self.last_reused = store.compiled(key, lowered)
        self.from_cache += _hits[0] > hits
        if self.last_reused:
            self.reused += 1
        else:
            self.fresh += 1
        self.keys.add(key)
        self.last_key = key
        return found

    def executable(
        self, key: tuple[Any, ...], lower: Callable[[], jax.stages.Lowered]
    ) -> jax.stages.Compiled:
        """The executable of the program of `key` (this plan's), compiled
        from `lower()` again (and counted) where an earlier plan kept only
        its figures."""
        if not store.has_executable(key):
            self.fresh += 1
        return store.executable(key, lower)

    def keep_only(self, chosen: tuple[Any, ...] | None) -> None:
        """The executables this plan compiled or found dropped, but that of
        the key `chosen` (the others' figures kept for the next plan)."""
        store.keep_only(self.keys, chosen)
