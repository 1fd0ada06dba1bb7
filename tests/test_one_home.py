"""The run's one mutable home is written from one place (issue 55): no
module but ``_state/_run.py`` assigns a `RunSlot`'s run (every change goes
through `put`, `advance`, `settle`), and no module but
``_assembly/_current.py`` assigns a `CurrentFit`'s fields (it changes
through the moments its methods name). Checked on the source: an
assignment (plain, augmented, annotated, in a tuple, or by `setattr`) to
such an attribute of anything but the module's own `self`."""

import ast
from pathlib import Path

import pytest

import phalanx as px
from phalanx._assembly._current import CurrentFit
from phalanx._state._progress import RunProgress
from phalanx._state._run import Run, RunSlot


SRC = Path(px.__file__).parent
# Each home: the module that may write it, and the attributes it keeps.
HOMES = {
    "_state/_run.py": ("run", "_run"),
    "_assembly/_current.py": tuple(
        name
        for field in ("events", "position", "totals", "clock", "restored")
        for name in (field, f"_{field}")
    ),
}


def _targets(node: ast.AST) -> list[ast.expr]:
    """What `node` assigns or deletes (none for other nodes)."""
    if isinstance(node, ast.Assign | ast.Delete):
        return node.targets
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def _by_name(node: ast.Call, attributes: tuple[str, ...]) -> bool:
    """Whether `node` is ``setattr``/``delattr``/``__setattr__`` of one of
    `attributes`, named as a string."""
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    return name in ("setattr", "delattr", "__setattr__") and any(
        isinstance(a, ast.Constant) and a.value in attributes for a in node.args
    )


def writes(source: str, attributes: tuple[str, ...]) -> list[str]:
    """Each assignment to one of `attributes` of an object other than the
    bare name `self`, as ``line: target``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _by_name(node, attributes):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        for target in _targets(node):
            for part in ast.walk(target):
                if not isinstance(part, ast.Attribute) or part.attr not in attributes:
                    continue
                owner = part.value
                if not (isinstance(owner, ast.Name) and owner.id == "self"):
                    found.append(f"{part.lineno}: {ast.unparse(part)}")
    return sorted(found)


@pytest.mark.parametrize("home", sorted(HOMES))
def test_a_home_is_written_only_by_its_own_module(home):
    attributes = HOMES[home]
    found = {
        str(path.relative_to(SRC)): hits
        for path in sorted(SRC.rglob("*.py"))
        if str(path.relative_to(SRC)) != home
        if (hits := writes(path.read_text(), attributes))
    }
    assert found == {}


def test_the_check_finds_a_write():
    source = (
        "def f(parts, slot, current):\n"
        "    slot.run = run\n"  # found
        "    parts.slot.run = run\n"  # found
        "    a, slot._run = b, run\n"  # found, in a tuple
        "    setattr(slot, 'run', run)\n"  # found
        "    current.restored = True\n"  # another home's: not this check's
        "    self.run = run\n"  # its own field
        "    x = slot.run\n"  # a read
    )
    assert writes(source, HOMES["_state/_run.py"]) == [
        "2: slot.run",
        "3: parts.slot.run",
        "4: slot._run",
        "5: setattr(slot, 'run', run)",
    ]


def test_a_slot_and_a_current_fit_refuse_a_plain_write():
    # Their fields are read-only from outside: the check above has a
    # second line of defence at run time.
    slot = RunSlot(Run([], RunProgress()))
    with pytest.raises(AttributeError):
        slot.run = Run([], RunProgress())  # type: ignore[misc]
    current = CurrentFit()
    with pytest.raises(AttributeError):
        current.restored = True  # type: ignore[misc]
