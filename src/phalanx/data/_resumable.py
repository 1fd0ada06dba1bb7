"""`Resumable`: the protocol of data that can say where it stands and go back
there, so that a resumed fit continues with the next batch. A protocol only:
loaders satisfy it by having the two methods (no base class to inherit);
nothing here reads data or imports JAX."""

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Resumable(Protocol):
    """Data that can say where it stands and go back there (e.g.
    `px.data.ArrayLoader`; as with PyTorch's stateful data loaders).

    A checkpoint stores `state_dict()` after the last batch trained on, and a
    resumed fit calls `load_state_dict` with it, so the data continues
    exactly. Data that is not `Resumable` but can be iterated again
    restarts its epoch on resume and skips the batches already trained on.
    """

    def state_dict(self) -> Any:
        """Where the data stands, as plain (JSON) data."""
        ...

    def load_state_dict(self, state: Any) -> None:
        """Go back to where `state_dict` said."""
        ...
