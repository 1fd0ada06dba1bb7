"""Code reaches through nothing it is handed (issue 55): no attribute chain
of three hops or more (``parts.slot.run.leaves``) on a function's parameter,
`self` aside, in the trainer's assembly, the planner and the engine's rooms.
A function that needs what an object holds two levels down is handed that
instead, or the object says it (a property, a method)."""

import ast
from pathlib import Path

import pytest


SRC = Path(__file__).resolve().parents[1] / "src" / "phalanx"
ROOMS = ("_assembly", "_plan", "_engine")


def chains(source: str) -> list[str]:
    """Each longest chain of three or more attribute hops rooted at a
    parameter of the function it is in (not `self` or `cls`), as
    ``line: a.b.c.d``."""
    found = set()
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        arguments = function.args
        names = {
            a.arg
            for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
        } - {"self", "cls"}
        inner = {
            id(node.value)
            for node in ast.walk(function)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
        }
        for node in ast.walk(function):
            if not isinstance(node, ast.Attribute) or id(node) in inner:
                continue
            hops, root = 0, node
            while isinstance(root, ast.Attribute):
                hops, root = hops + 1, root.value
            if hops >= 3 and isinstance(root, ast.Name) and root.id in names:
                found.add(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


@pytest.mark.parametrize("room", ROOMS)
def test_no_code_reaches_through_what_it_is_handed(room):
    found = {
        str(path.relative_to(SRC)): hits
        for path in sorted((SRC / room).rglob("*.py"))
        if (hits := chains(path.read_text()))
    }
    assert found == {}


def test_the_check_finds_a_reach():
    source = (
        "def f(parts, self):\n"
        "    a = parts.slot.run.leaves\n"  # three hops: found
        "    b = parts.slot.run\n"  # two: fine
        "    c = self.x.y.z\n"  # its own fields
        "    return parts.programs.parts.step.strategy\n"  # the longest only
    )
    assert chains(source) == [
        "2: parts.slot.run.leaves",
        "5: parts.programs.parts.step.strategy",
    ]
