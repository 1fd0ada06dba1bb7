"""Host-side data: an array loader and small data sets (NumPy only)."""

from ._digits import load_digits as load_digits
from ._loader import ArrayLoader as ArrayLoader
from ._mnist import load_mnist as load_mnist
from ._resumable import Resumable as Resumable
