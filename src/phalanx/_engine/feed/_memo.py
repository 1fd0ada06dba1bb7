"""`Memo`: values made once each, at most a bounded number remembered."""

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar


_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


class Memo(Generic[_K, _V]):
    """Values by key, made once each: at most `size` remembered (the first
    ones; a pass's few batch sizes and totals repeat, and anything past
    the bound is made again each time instead of growing without end)."""

    def __init__(self, size: int = 64):
        self._values: dict[_K, _V] = {}
        self._size = size

    def get(self, key: _K) -> _V | None:
        return self._values.get(key)

    def remember(self, key: _K, value: _V) -> _V:
        """Keep `value` for `key` while there is room; return it."""
        if len(self._values) < self._size:
            self._values[key] = value
        return value

    def get_or_make(self, key: _K, make: Callable[[], _V]) -> _V:
        """The value for `key`, made (and remembered) the first time."""
        value = self._values.get(key)
        return self.remember(key, make()) if value is None else value
