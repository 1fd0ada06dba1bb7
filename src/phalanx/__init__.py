"""phalanx: data-parallel training for Equinox models on JAX.

The public names are those of ``__init__.pyi``; each is imported on first
use (`lazy_loader`), so ``phalanx --help`` and ``import phalanx`` do not
start JAX until it is needed.
"""

import lazy_loader


__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
