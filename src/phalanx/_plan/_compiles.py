"""A plan's compiles, kept for the process: a candidate compiled by one plan
is not compiled again by the next (the same trainer, batch and space
planned twice, a tighter budget after a roomy one), nor twice in one.

A compiled program is keyed by what determines it: the text of the
lowered module (the step's computation with its shardings, donations and
mesh, as XLA is given it) and the devices it runs on; the same text on the
same devices compiles to the same executable in one process. Lowering is
cheap beside compiling (a trace, not XLA's passes), and the key costs one
hash of the text.
"""

import collections
import hashlib
from collections.abc import Sequence
from typing import Any

import jax


# The compiled programs kept, the most recently used: a plan of ~30
# candidates twice over; each holds its executable (on an accelerator, its
# code loaded on the devices).
KEPT = 64
_STORE: collections.OrderedDict[tuple[Any, ...], jax.stages.Compiled] = (
    collections.OrderedDict()
)


class Compiles:
    """One plan's compiles through the process' store.

    Attributes:
        fresh: the programs it compiled.
        reused: those it found compiled (by an earlier plan, or earlier in
            this one).
        last: the last program it compiled or found.
        last_reused: whether that one was found.
    """

    def __init__(self, devices: Sequence[Any]):
        self._devices = tuple((d.platform, d.id) for d in devices)
        self.fresh = 0
        self.reused = 0
        self.last: jax.stages.Compiled | None = None
        self.last_reused = False

    def compile(self, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
        """`lowered` compiled, or found compiled in the store."""
        text = lowered.as_text()
        key = (self._devices, hashlib.sha256(text.encode()).hexdigest())
        found = _STORE.get(key)
        self.last_reused = found is not None
        if found is None:
            found = lowered.compile()  # XLA's refusal propagates, not kept
            _STORE[key] = found
            while len(_STORE) > KEPT:
                _STORE.popitem(last=False)
            self.fresh += 1
        else:
            _STORE.move_to_end(key)
            self.reused += 1
        self.last = found
        return found
