"""The heart of the library is typed: every function of the step modules
(their nested functions included) annotates each parameter and its return,
and no step module outgrows one concept (400 lines)."""

import ast
from pathlib import Path

import pytest


ENGINE = Path(__file__).resolve().parents[2] / "src" / "phalanx" / "_engine"
STEP_MODULES = (
    "_step.py",
    "_step_parts.py",
    "_slice.py",
    "_gradient.py",
    "_guard.py",
)


def unannotated(source: str) -> list[str]:
    """The functions of `source` missing an annotation: ``name(param)`` for
    a parameter, ``name() ->`` for the return (``self``/``cls`` excepted)."""
    missing = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        arguments = node.args
        every = [
            *arguments.posonlyargs,
            *arguments.args,
            *arguments.kwonlyargs,
            *filter(None, [arguments.vararg, arguments.kwarg]),
        ]
        for argument in every:
            if argument.annotation is None and argument.arg not in ("self", "cls"):
                missing.append(f"{node.name}({argument.arg}) line {node.lineno}")
        if node.returns is None and node.name != "__init__":
            missing.append(f"{node.name}() -> line {node.lineno}")
    return missing


@pytest.mark.parametrize("module", STEP_MODULES)
def test_every_step_function_is_annotated(module):
    source = (ENGINE / module).read_text()
    assert unannotated(source) == []
    assert len(source.splitlines()) <= 400


def test_the_check_finds_a_missing_annotation():
    source = "def f(a: int, b) -> int:\n    def g(c: int):\n        return c\n"
    assert unannotated(source) == ["f(b) line 1", "g() -> line 2"]
