"""Every function in `_engine/`'s rooms is annotated: each argument (not
`self`) and the return (not `__init__`'s), nested closures included."""

import ast
import pathlib

import phalanx._engine


ENGINE = pathlib.Path(phalanx._engine.__file__).parent


def _unannotated(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        args = node.args
        named = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        missing = [a.arg for a in named if a.annotation is None]
        missing = [name for name in missing if name not in ("self", "cls")]
        for star in (args.vararg, args.kwarg):
            if star is not None and star.annotation is None:
                missing.append(star.arg)
        if node.returns is None and node.name != "__init__":
            missing.append("return")
        if missing:
            found.append(f"{path.name}:{node.lineno} {node.name} {missing}")
    return found


def test_every_engine_function_is_annotated():
    files = sorted(ENGINE.rglob("*.py"))
    assert files, ENGINE
    found = [entry for path in files for entry in _unannotated(path)]
    assert found == []


def test_the_check_finds_a_missing_annotation(tmp_path):
    path = tmp_path / "bare.py"
    path.write_text("def f(x, y: int) -> int:\n    def g(z):\n        return z\n")
    assert _unannotated(path) == ["bare.py:1 f ['x']", "bare.py:2 g ['z', 'return']"]
