"""The architecture's rules, checked on the source (issue 16): no module
reaches into the trainer's private fields, and the import graph of
`phalanx` has no cycle, counting imports under ``TYPE_CHECKING`` and inside
functions (the layers themselves are `lint-imports`' contract in CI). The code
stands alone (issue 30): every module has a docstring, no comment points to
notes outside the repository, and the package root holds few modules."""

import ast
import pathlib
import re

import grimp

import phalanx as px


SRC = pathlib.Path(px.__file__).parent
# ``trainer._x``, ``self._trainer._x``, ``info.trainer._x``: another object's
# private field read through the trainer.
PRIVATE_ACCESS = re.compile(r"\b(?:trainer|_trainer)\._[A-Za-z]")


def test_no_module_but_the_trainer_touches_its_private_fields():
    offenders = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "_trainer.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE_ACCESS.search(line)
    ]
    assert offenders == []


def test_the_check_finds_private_access():
    # The pattern the test above relies on does match what it forbids.
    assert PRIVATE_ACCESS.search("step = trainer._step")
    assert PRIVATE_ACCESS.search("self._trainer._leaves = leaves")
    assert not PRIVATE_ACCESS.search("trainer.state, trainer_state._x")


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import graph's strongly connected components of more than one
    module (Tarjan's algorithm), or modules that import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_the_import_graph_has_no_cycle():
    graph = grimp.build_graph("phalanx", exclude_type_checking_imports=False)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for module in ("a", "b", "c"):
        graph.add_module(module)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    assert _cycles(graph) == []
    graph.add_import(importer="c", imported="a")
    assert _cycles(graph) == [["a", "b", "c"]]


# Pointers to notes outside the repository ("NOTES trap 3"): the code states
# the fact itself, or cites docs/architecture.md.
OUTSIDE_POINTER = re.compile(r"\bNOTES\b|\b[Tt]rap \d")
INVARIANT = re.compile(r"\b[Ii]nvariant (\d+)")
ARCHITECTURE = pathlib.Path(__file__).parents[1] / "docs" / "architecture.md"


def test_every_module_says_what_it_is_for():
    missing = [
        str(path.relative_to(SRC))
        for path in sorted(SRC.rglob("*.py"))
        if not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert not missing, f"modules without a module docstring: {missing}"


def test_the_code_points_nowhere_outside_the_repository():
    lines = [
        (f"{path.relative_to(SRC)}:{number}: {line.strip()}", line)
        for path in sorted(SRC.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
    ]
    assert [where for where, line in lines if OUTSIDE_POINTER.search(line)] == []
    # Every invariant the code cites is one docs/architecture.md defines.
    section = ARCHITECTURE.read_text().split("\n## Invariants\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    defined = set(re.findall(r"^(\d+)\. ", section, re.MULTILINE))
    undefined = [
        where
        for where, line in lines
        for number in INVARIANT.findall(line)
        if number not in defined
    ]
    assert undefined == []


def test_the_package_root_holds_few_modules():
    # Everything else lives in a folder per layer (cli/, _engine/, ...).
    assert len(list(SRC.glob("*.py"))) <= 15


def test_the_pointer_checks_match_what_they_forbid():
    assert OUTSIDE_POINTER.search("(NOTES-jax-cpu trap 1)")
    assert OUTSIDE_POINTER.search("see trap 4")
    assert not OUTSIDE_POINTER.search("the loop notes the signal")
    assert INVARIANT.findall("(invariant 5 of docs/architecture.md)") == ["5"]
