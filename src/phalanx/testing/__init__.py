"""Check that your own trainer, loss and collectives are exact under every
strategy: `assert_equivalent`, usable as a pytest helper."""

from ._equivalence import assert_equivalent as assert_equivalent
from ._report import Equivalence as Equivalence
