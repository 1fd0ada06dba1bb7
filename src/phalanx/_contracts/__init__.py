"""What the layers below a model know of it, at the bottom of the layers so
that strategies, the engine and models all see it without importing each
other: layers stored stacked (`AbstractStacked`), and sequences split over
devices (`SequenceSplit`)."""

from ._sequence import (
    SequenceSplit as SequenceSplit,
    sequence_split as sequence_split,
    splitting_sequences as splitting_sequences,
)
from ._stacking import AbstractStacked as AbstractStacked, with_static as with_static
