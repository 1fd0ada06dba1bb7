"""A strategy's name as summaries and `assert_equivalent` show it: its
class, with what a wrapper wraps and what its registry entry shows (a
mesh's sizes)."""

from ._accumulating import AccumulatingStrategy
from ._registry import entry_of
from ._strategy import Strategy


def strategy_name(strategy: Strategy) -> str:
    """The strategy's class, with what a wrapper wraps and the details its
    registry entry shows (a mesh's sizes above 1):
    ``AccumulatingStrategy(PmapStrategy, microbatches=4)``,
    ``MeshStrategy(data=2, fsdp=4)``; an unregistered class by its name."""
    name = type(strategy).__name__
    if isinstance(strategy, AccumulatingStrategy):
        inner = strategy_name(strategy.inner)
        return f"{name}({inner}, microbatches={strategy.microbatches})"
    entry = entry_of(strategy)
    details = "" if entry is None else entry.details(strategy)
    return f"{name}({details})" if details else name
