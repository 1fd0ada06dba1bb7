"""What a fit does with Python's garbage collector (the trainer's ``gc=``).

Python's automatic collector runs whenever allocations pass a threshold,
wherever the loop happens to be; a full collection walks every tracked
object (JAX's caches, the model's pytrees, the user's data), so a long run
sees a step every so often that takes many times the median (equinox#1145).
Under ``"auto"`` the automatic collector is off during the loop; the loop
collects where the host waits for the device anyway (`at_sync`, `at_epoch_end`),
and the objects alive at the first of those points (after the first step,
its compile and caches included) are frozen out of every later collection.
The user's settings come back when the loop ends, however it ends. Nothing
here touches a device.
"""

import gc

from .._typing import GCMode


class Collector:
    """One fit's garbage-collection policy, as a context manager around its
    loop (see the module)."""

    def __init__(self, mode: GCMode):
        self.mode = mode
        self.collections = 0  # made by this policy (not Python's own)
        self._enabled = True
        self._threshold: tuple[int, ...] = ()
        self._frozen = False  # whether this fit froze objects (to unfreeze)
        self._first = True

    def __enter__(self) -> "Collector":
        self._enabled = gc.isenabled()
        self._threshold = gc.get_threshold()
        self._frozen, self._first = False, True
        if self.mode != "python":
            gc.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
        gc.set_threshold(*self._threshold)
        if self._enabled:
            gc.enable()
        else:
            gc.disable()

    def at_sync(self) -> None:
        """A sync point, before the host waits: under ``"auto"``, collect
        the young generations (the garbage made since the last point); at
        the fit's first point, then freeze what is alive (a full collection
        there, of JAX's caches and all, took ~0.2 s on 2 CPU cores)."""
        if self.mode != "auto":
            return
        gc.collect(1)
        self.collections += 1
        if self._first:
            self._first = False
            # gc.unfreeze() thaws every frozen object: where the user froze
            # some before fit, freezing here could not be undone alone. (Old
            # garbage frozen with the rest is freed after the fit.)
            if gc.get_freeze_count() == 0:
                gc.freeze()
                self._frozen = True

    def at_epoch_end(self) -> None:
        """An epoch's end, before the host waits for its sums: under
        ``"auto"``, a full collection (of what was not frozen)."""
        if self.mode != "auto":
            return
        if self._first:
            self.at_sync()
            return
        gc.collect()
        self.collections += 1
