"""The loop reaches through no object it is handed: no attribute chain of
three names or more (``a.b.c``) on a function's parameters in `_loop.py`
and its calls' `_loop_calls.py` (modules, as ``jax.tree.leaves``, are not
handed to it)."""

import ast
from pathlib import Path


ENGINE = Path(__file__).resolve().parents[2] / "src" / "phalanx" / "_engine"
LOOP = ENGINE / "_loop.py"
CALLS = ENGINE / "_loop_calls.py"  # the loop's compiled calls


def chains(source: str) -> list[str]:
    """Each ``a.b.c`` (or longer) rooted at a parameter of the function it
    is in, as ``line: a.b.c``."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef):
            continue
        arguments = function.args
        names = {
            a.arg
            for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
        }
        for node in ast.walk(function):
            if not isinstance(node, ast.Attribute) or not isinstance(
                node.value, ast.Attribute
            ):
                continue
            root = node.value.value
            if isinstance(root, ast.Name) and root.id in names:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found))


def test_the_loop_reaches_through_nothing_it_is_handed():
    source = LOOP.read_text()
    assert chains(source) == []
    assert chains(CALLS.read_text()) == []
    assert len(source.splitlines()) <= 400


def test_the_check_finds_a_chain():
    source = (
        "def f(slot, events):\n"
        "    x = slot.run.progress\n"
        "    y = events.stopping()\n"
        "    z = jax.tree.leaves(x)\n"
        "    return slot.run.leaves[0].shape\n"
    )
    assert chains(source) == ["2: slot.run.progress", "5: slot.run.leaves"]
