"""A strategy's name as summaries and `assert_equivalent` show it: its
class, with what a wrapper wraps and a mesh's sizes."""

from ._accumulating import AccumulatingStrategy
from ._mesh_strategy import MeshStrategy
from ._strategy import Strategy


def strategy_name(strategy: Strategy) -> str:
    """The strategy's class, with what a wrapper wraps and a mesh's sizes
    (those above 1): ``AccumulatingStrategy(PmapStrategy, microbatches=4)``,
    ``MeshStrategy(data=2, fsdp=4)``."""
    name = type(strategy).__name__
    if isinstance(strategy, AccumulatingStrategy):
        inner = strategy_name(strategy.inner)
        return f"{name}({inner}, microbatches={strategy.microbatches})"
    if isinstance(strategy, MeshStrategy):
        sizes = dict(strategy.mesh.shape)
        shown = [f"{axis}={size}" for axis, size in sizes.items() if size > 1]
        return f"{name}({', '.join(shown or ['data=1'])})"
    return name
