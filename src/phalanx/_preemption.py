"""Stopping a fit cleanly on SIGTERM / SIGINT.

The handler only records the signal and tells the fit; the loop stops at the
next step boundary, once the snapshot stores have saved. Nothing is stopped
mid-step, and signals are handled on the main thread only.
"""

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any


class Preempted(KeyboardInterrupt):
    """`fit` stopped on SIGTERM/SIGINT after saving a checkpoint."""

    def __init__(self, signum: int, checkpoint: str | None):
        self.signum = signum
        self.exit_code = 128 + signum
        saved = f"; checkpoint saved in {checkpoint}" if checkpoint else ""
        super().__init__(
            f"stopped by {signal.Signals(signum).name} at a step boundary{saved}"
        )


@contextlib.contextmanager
def preemption(on_signal: Callable[[int], None]) -> Iterator[None]:
    """On SIGTERM or SIGINT, call `on_signal(signum)`; a second SIGINT aborts.

    The fit's loop notes the signal and stops at the next step boundary,
    where every snapshot store saves and waits for the write to be
    committed, and `fit` raises `Preempted` (a KeyboardInterrupt; exit code
    128 + signal). Signals are caught on the main thread only (Python
    delivers them there).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        del frame
        if received and signum == signal.SIGINT:
            raise KeyboardInterrupt("second SIGINT: aborted without a checkpoint")
        received.append(signum)
        on_signal(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
