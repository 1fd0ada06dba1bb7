"""`SequenceSplit`: what attention knows of a sequence split over devices.

`MeshStrategy(context=N)` splits each example's sequence dimension over
the mesh axis ``"context"``. Everything per position (embeddings, MLPs,
norms) computes on its slice unchanged; attention, which mixes positions,
must exchange them (`phalanx.models.dot_product_attention`). The strategy
says so while its step is traced (`splitting_sequences`), and attention asks
(`sequence_split`): here, at the bottom of the layers, so that strategies
and models see it without importing each other.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """Each example's sequence is split over `axis` of `mesh`.

    Attributes:
        mesh: the strategy's mesh.
        axis: the mesh axis the sequence is split over (``"context"``).
        batch_axes: the mesh axes the examples are split over where the
            model runs in the global view (`jax.vmap` over the examples with
            ``spmd_axis_name=batch_axes``): attention's own `jax.shard_map`
            is manual over them too. Empty inside a per-device program,
            whose examples are already this device's.
    """

    mesh: Mesh
    axis: str
    batch_axes: tuple[str, ...]

    @property
    def size(self) -> int:
        """The devices each sequence is split over."""
        return int(self.mesh.shape[self.axis])


# The split being traced, and whether anything asked for it (`asked`).
_CURRENT: contextvars.ContextVar[tuple[SequenceSplit, list[bool]] | None] = (
    contextvars.ContextVar("phalanx_sequence_split", default=None)
)


def sequence_split(*, record: bool = True) -> SequenceSplit | None:
    """The sequence split of the step being traced; None where each example's
    sequence is whole on its devices. Asking is recorded (`splitting_sequences`
    says whether the model asked), unless `record` is False (phalanx's own
    look, not the model's)."""
    current = _CURRENT.get()
    if current is None:
        return None
    split, asked = current
    asked[0] = asked[0] or record
    return split


@contextlib.contextmanager
def splitting_sequences(split: SequenceSplit | None) -> Iterator[list[bool]]:
    """Trace the model with `split` as the sequence split (None: whole);
    yields a flag (``[asked]``) that says, once the trace is done, whether
    anything in the model asked for it (`sequence_split`): attention that
    did not splits nothing (XLA gathers each whole sequence for it)."""
    asked = [False]
    token = _CURRENT.set(None if split is None else (split, asked))
    try:
        yield asked
    finally:
        _CURRENT.reset(token)
