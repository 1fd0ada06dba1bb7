"""phalanx's version, in one place: read by the build (pyproject.toml),
``phalanx --version`` and checkpoints' metadata; it imports nothing."""

__version__ = "0.1.0"
