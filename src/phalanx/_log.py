"""phalanx's own log lines: the ``"phalanx"`` logger, printed to stderr.

As Lightning does for its logger, phalanx gives this logger a handler of its
own at INFO, so a user sees what phalanx decided for them (a fresh start
where nothing could be resumed, a damaged checkpoint skipped) without
configuring logging. Quiet it with
``logging.getLogger("phalanx").setLevel(logging.WARNING)``, or send it
elsewhere by replacing its handlers.
"""

import logging
import sys
from typing import Any


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever `sys.stderr` is at the time (a test's
    capture, a redirected stream), not to the one at import."""

    @property
    def stream(self) -> Any:  # pyright: ignore[reportIncompatibleVariableOverride]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        del value


logger = logging.getLogger("phalanx")
if not logger.handlers:
    _handler = _Stderr()
    _handler.setFormatter(logging.Formatter("phalanx: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
