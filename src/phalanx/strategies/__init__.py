"""How a training step runs across devices: the strategy contract, the mesh
strategy base, the built-in strategies, their registry, and models built in
their shards.

The public names are those of ``__init__.pyi``, each imported on first use
(`lazy_loader`, as the top-level package): the strategy registry
(``_registry.py``) is read by the command line's parser, which must answer
``phalanx train --help`` without starting JAX.
"""

import lazy_loader


__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
