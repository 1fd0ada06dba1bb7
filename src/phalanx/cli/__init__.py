"""The ``phalanx`` command line: ``phalanx train``, ``phalanx find-lr``,
``phalanx launch``."""

from ._main import main as main
