"""The ``phalanx`` command line: ``phalanx train``, ``phalanx launch``."""

from ._main import main as main
