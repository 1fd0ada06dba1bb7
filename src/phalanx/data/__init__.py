"""Host-side data: an array loader, a Grain loader for data on disk, and
small data sets."""

from ._digits import load_digits as load_digits
from ._grain import GrainLoader as GrainLoader
from ._loader import ArrayLoader as ArrayLoader
from ._mnist import load_mnist as load_mnist
from ._records import Records as Records, write_records as write_records
from ._resumable import Resumable as Resumable
