"""Train steps a plan compiled in this process, kept by what determines
them: the plan's compile of the call a fit makes first is that fit's own
program (`px.plan`, then `fit` of its choice: one compile, one executable
on the device; the fit `take`s it), and a candidate compiled by one plan is
not compiled again by the next (the same trainer, batch and space planned
twice, a tighter budget after a roomy one), nor twice in one. A fit keeps
nothing here: what it compiles lives as long as its trainer.

A program is keyed by the text of its lowered module (the step's
computation with its shardings, donations and mesh shape, as XLA is given
it) and the devices it runs on, in its mesh's order (the text names none);
the same text on the same devices compiles to the same executable in one
process. Lowering is cheap beside compiling (a trace, not XLA's passes),
and the key costs one hash of the text.

An executable holds its code in device memory (67-83 MB a step of the
tests' 19 M transformer on a TPU v5e): after a plan only its choice's is
kept (`keep_only`); the others keep their figures (`Figures`: the text and
memory analysis a plan's costs are read from), enough for the next plan to
cost them again without compiling.
"""

import collections
import hashlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax


# The programs kept, the most recently used: a plan of ~30 candidates twice
# over.
KEPT = 64


class Figures(NamedTuple):
    """What a plan reads from a compiled program, kept without the
    executable: `as_text` and `memory_analysis`, as `jax.stages.Compiled`'s."""

    text: str
    memory: Any

    def as_text(self) -> str:
        return self.text

    def memory_analysis(self) -> Any:
        return self.memory


Kept = jax.stages.Compiled | Figures
_STORE: collections.OrderedDict[tuple[Any, ...], Kept] = collections.OrderedDict()


def key_of(lowered: jax.stages.Lowered, arguments: tuple[Any, ...]) -> tuple[Any, ...]:
    """The key of `lowered`, a train call lowered for `arguments` (its
    abstract arguments, the state's leaves first, each laid out by a
    `NamedSharding` on the step's mesh)."""
    sharding = arguments[0][0].sharding  # a state leaf's: `state_layout`'s
    assert isinstance(sharding, jax.sharding.NamedSharding), sharding
    devices = list(sharding.mesh.devices.flat)  # pyright: ignore[reportOptionalMemberAccess]
    text = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    return (tuple((d.platform, d.id) for d in devices), text)


def compiled(key: tuple[Any, ...], lowered: jax.stages.Lowered) -> tuple[Kept, bool]:
    """The program of `key`: kept (an executable, or a plan's figures of
    one), or `lowered` compiled and kept; and whether it was kept.

    Raises:
        JaxRuntimeError: XLA refused the program (nothing is kept).
    """
    found = _STORE.get(key)
    if found is not None:
        _STORE.move_to_end(key)
        return found, True
    made = lowered.compile()
    _STORE[key] = made
    while len(_STORE) > KEPT:
        _STORE.popitem(last=False)
    return made, False


def executable(
    key: tuple[Any, ...], lower: Callable[[], jax.stages.Lowered]
) -> jax.stages.Compiled:
    """The executable of `key`: kept, or compiled from `lower()` (not kept,
    or only its figures were) and kept."""
    found = _STORE.get(key)
    if isinstance(found, jax.stages.Compiled):
        _STORE.move_to_end(key)
        return found
    _STORE.pop(key, None)
    made, _ = compiled(key, lower())
    assert isinstance(made, jax.stages.Compiled)
    return made


def take(key: tuple[Any, ...]) -> jax.stages.Compiled | None:
    """The executable of `key` where a plan kept it, handed over: the store
    keeps only its figures from now on (the taker, a fit, holds it as long
    as it needs it)."""
    found = _STORE.get(key)
    if not isinstance(found, jax.stages.Compiled):
        return None
    _STORE[key] = _figures(found)
    return found


def holding() -> bool:
    """Whether any executable is kept (a fit looks for one only then: its
    key hashes the program's whole text)."""
    return any(isinstance(kept, jax.stages.Compiled) for kept in _STORE.values())


def has_executable(key: tuple[Any, ...]) -> bool:
    """Whether the program of `key` is kept with its executable."""
    return isinstance(_STORE.get(key), jax.stages.Compiled)


def keep_only(keys: set[tuple[Any, ...]], kept: tuple[Any, ...] | None) -> None:
    """Of the programs of `keys` (one plan's), the executable of `kept`
    alone stays; the others' are dropped, their figures kept."""
    for key in keys - {kept}:
        found = _STORE.get(key)
        if isinstance(found, jax.stages.Compiled):
            _STORE[key] = _figures(found)


def _figures(compiled: jax.stages.Compiled) -> Figures:
    return Figures(compiled.as_text() or "", compiled.memory_analysis())
