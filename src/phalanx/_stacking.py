"""`AbstractStacked`: what a strategy knows of layers stored stacked.

A module of this kind holds layers of one structure as one module whose
arrays have a leading layer axis (`phalanx.models.Stacked`). A strategy that
splits arrays by size (`MeshStrategy`) never splits that axis: the layers
are applied one after another, and each is gathered whole on its turn.
Here, at the bottom of the layers, so that strategies and models both see it
without importing each other.
"""

from typing import Any

import equinox as eqx


class AbstractStacked(eqx.Module):
    """Layers stored stacked: `layers` is one module whose arrays each have
    a leading axis of one entry per layer."""

    layers: eqx.AbstractVar[Any]
