"""Every Python example in phalanx's docstrings runs.

An example is a fenced ```` ```python ```` block in a docstring (of a
module, class, function, method or attribute) anywhere in ``src/phalanx``,
found by parsing the source, not by importing it. The line before the fence
(blank lines aside) may say how it runs, as the docs' Markdown pages do
(test_docs.py), in an HTML comment the API reference does not show:

- ``<!-- skip: REASON -->``: not run, e.g. it needs a GPU, a server or
  files this machine has not; the test reports it skipped with the reason.
- ``<!-- raises: NAME -->``: the example shows an error; it must raise the
  exception class NAME (or a subclass).

The examples run in one process (8 CPU devices: ``JAX_PLATFORMS=cpu``,
``JAX_NUM_CPU_DEVICES=8``, ``NPROC=16``; logging configured as a user
would), each in a folder of its own and in a namespace of its own holding
`PREAMBLE`'s names: the imports and small objects an example may assume
(``px``, ``jnp``, ``optax``, a model, digits arrays ``x, y``, a loader
``data``, a ``trainer``, ...). Names an example does not find there it
must define itself. No line of another library (absl, orbax, a Python
warning) may appear in an example's output.

A block of methods only (``def metrics(self, outputs, targets): ...``, each
function's first parameter ``self``), as the trainer's hooks are shown, is
run as the body of a `px.DataParallelTrainer` subclass, which is then built
on the preamble's model and evaluated on its test set.
"""

import ast
import json
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

import forkserver
from test_docs import third_party_lines


ROOT = Path(__file__).resolve().parent.parent.parent
SRC = ROOT / "src" / "phalanx"

# The names every example may use. Run once; `FRESH` then runs before each
# example, so that the trainer and loaders it finds are new.
PREAMBLE = """
import csv, functools, json, os
import equinox as eqx
import jax, jax.numpy as jnp, jax.random as jr
import numpy as np, optax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float
from typing_extensions import override
import phalanx as px
from phalanx.callbacks import *  # the callbacks' examples name their class bare

(x, y), (x_test, y_test) = px.data.load_digits()
x, y, x_test, y_test = x[:512], y[:512], x_test[:128], y_test[:128]
key = jr.key(0)
model = px.models.MLP(64, 10, key=key)  # 64-256-128-10, as examples build it

def Net(key):  # a model made from a key, as `px.sharded_model` takes one
    return px.models.MLP(64, 10, hidden=(32,), key=key)

class Gan(eqx.Module):  # a model of two parts, as a GAN's
    generator: eqx.nn.MLP
    discriminator: eqx.nn.MLP

    def __call__(self, x):
        return self.discriminator(self.generator(x))

gan = Gan(
    eqx.nn.MLP(8, 64, 32, 1, key=jr.key(1)), eqx.nn.MLP(64, 1, 32, 1, key=jr.key(2))
)
BertClassifier = eqx.Module  # the class of Equinox's BERT example's model
"""

FRESH = """
data = train = loader = px.data.ArrayLoader((x, y), batch_size=128)  # 4 batches
test = val = [(x_test, y_test)]
trainer = px.DataParallelTrainer(model, optax.adam(1e-3))
logger = px.callbacks.CSVLogger("log.csv")
"""

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+)\s*(?P<info>[^\n]*)$")
_MARK = re.compile(
    r"^\s*<!--\s*(?P<kind>skip|raises)\b(?P<colon>:?)(?P<value>.*?)-->\s*$"
)


class Example(NamedTuple):
    file: Path
    line: int  # of its first code line in the file, 1-based
    owner: str  # what the docstring documents, e.g. "DataParallelTrainer.fit"
    code: str  # dedented
    skip: str | None  # why it is not run; None: it runs
    raises: str | None  # the exception class it must raise; None: none

    @property
    def id(self) -> str:
        return f"{self.file.relative_to(SRC)}:{self.line}"


def _docstrings(tree: ast.Module) -> list[tuple[str, int, str]]:
    """Every docstring of a module (its own, and its classes', functions'
    and attributes'): the name of what it documents, its literal's first
    line, its text."""
    found: list[tuple[str, int, str]] = []

    def visit(body: list[ast.stmt], owner: str) -> None:
        for statement in body:
            if (
                isinstance(statement, ast.Expr)
                and isinstance(statement.value, ast.Constant)
                and isinstance(statement.value.value, str)
            ):
                found.append((owner, statement.value.lineno, statement.value.value))
            elif isinstance(statement, ast.ClassDef | ast.FunctionDef):
                visit(statement.body, f"{owner}.{statement.name}".lstrip("."))
            elif isinstance(statement, ast.If | ast.Try):  # TYPE_CHECKING, ...
                visit(statement.body, owner)

    visit(tree.body, "")
    return found


def examples_in(file: Path, source: str | None = None) -> list[Example]:
    """The fenced Python blocks of the docstrings of `file` (its text, or
    `source`). Raises ValueError for a marker with no reason or class."""
    examples = []
    text = file.read_text() if source is None else source
    for owner, lineno, docstring in _docstrings(ast.parse(text)):
        # The docstring's lines are the file's from the literal's first one
        # (no docstring here writes a newline as an escape).
        lines = docstring.splitlines()
        previous = None  # the last non-blank line outside a block
        i = 0
        while i < len(lines):
            opening = _FENCE.match(lines[i])
            if not opening:
                if lines[i].strip():
                    previous = lines[i]
                i += 1
                continue
            end = i + 1
            while end < len(lines) and not re.match(
                rf"^[ \t]*{opening['fence']}\s*$", lines[end]
            ):
                end += 1
            if (opening["info"].split() or [""])[0].lower() in ("python", "py"):
                mark = _MARK.match(previous) if previous else None
                value = mark["value"].strip() if mark else None
                where = f"{file}:{lineno + i - 1}"
                if mark and not (mark["colon"] and value):
                    raise ValueError(
                        f"{where}: a {mark['kind']} marker needs a "
                        f"{'reason' if mark['kind'] == 'skip' else 'class'}: "
                        "<!-- skip: needs a GPU -->, <!-- raises: ValueError -->"
                    )
                kind = mark["kind"] if mark else None
                examples.append(
                    Example(
                        file,
                        lineno + i + 1,
                        owner or "(module)",
                        textwrap.dedent("\n".join(lines[i + 1 : end])),
                        value if kind == "skip" else None,
                        value if kind == "raises" else None,
                    )
                )
            previous = None
            i = end + 1
    return examples


def docstring_examples() -> list[Example]:
    return [e for f in sorted(SRC.rglob("*.py")) for e in examples_in(f)]


EXAMPLES = docstring_examples()


def test_examples_are_found():
    # The parse finds the examples of modules, classes, methods, and the
    # skip marker (as a guard against a parse that silently finds none).
    owners = {(e.file.name, e.owner) for e in EXAMPLES}
    assert ("_trainer.py", "DataParallelTrainer") in owners
    # Methods' docstrings are read too (their examples would be found).
    trainer = (SRC / "_trainer.py").read_text()
    owners_read = {owner for owner, _, _ in _docstrings(ast.parse(trainer))}
    assert "DataParallelTrainer.compute_step" in owners_read
    assert ("_sharding.py", "ShardingStrategy") in owners
    assert any(e.skip for e in EXAMPLES) and any(e.raises for e in EXAMPLES)
    assert len(EXAMPLES) >= 40, len(EXAMPLES)


def test_examples_are_fenced_python():
    # A doctest (`>>> `) would be shown in the API reference and run by
    # nothing: write examples as ```python blocks, which this file runs.
    for file in sorted(SRC.rglob("*.py")):
        for owner, lineno, docstring in _docstrings(ast.parse(file.read_text())):
            assert not re.search(r"^\s*>>> ", docstring, re.M), (
                f"{file}:{lineno} ({owner}): a `>>>` example; write it "
                "as a ```python block (tests/docs/test_docstrings.py runs those)"
            )


def test_markers_are_read():
    source = '''
def f():
    """Doc.

    <!-- skip: needs a GPU -->
    ```python
    f()
    ```

    <!-- raises: ValueError -->

    ```python
    int("x")
    ```
    """
'''
    path = SRC / "_example.py"
    parsed = examples_in(path, source)
    assert [(e.line, e.owner, e.code, e.skip, e.raises) for e in parsed] == [
        (7, "f", "f()", "needs a GPU", None),
        (13, "f", 'int("x")', None, "ValueError"),
    ]
    with pytest.raises(ValueError, match="needs a reason"):
        examples_in(path, source.replace("skip: needs a GPU", "skip"))


# Runs the examples it is given, each in a fresh namespace and folder, and
# writes each one's error (None: it ran as it should) and seconds to a JSON
# file. An example's code is compiled as its source file with the code at its
# own lines, so that a traceback names the file and line. Log records and
# warnings are printed as test_docs.py's runner prints them, so that
# third_party_lines finds another library's.
_RUNNER = """
import json, logging, os, sys, time, traceback
logging.basicConfig(level=logging.WARNING, format="%(levelname)s:%(name)s:%(message)s")
logging.captureWarnings(True)
preamble, fresh, examples, out = json.load(open(sys.argv[1]))
base = {"__name__": "__main__"}
exec(compile(preamble, "PREAMBLE", "exec"), base)
root = os.getcwd()
results = {}

def run(example, namespace):
    exec(compile(fresh, "FRESH", "exec"), namespace)
    code = "\\n" * (example["line"] - 1) + example["code"]
    exec(compile(code, example["file"], "exec"), namespace)
    if example["hooks"]:  # a trainer's hooks: made a subclass, evaluated
        px, optax = namespace["px"], namespace["optax"]
        hooks = {name: namespace[name] for name in example["hooks"]}
        trainer = type("Example", (px.DataParallelTrainer,), hooks)(
            namespace["model"], optax.adam(1e-3)
        )
        print(trainer.evaluate(namespace["test"]))

for example in examples:
    os.chdir(root)
    os.makedirs(str(len(results)))
    os.chdir(str(len(results)))
    for stream in (sys.stdout, sys.stderr):
        print(f"--- {example['id']}", file=stream, flush=True)
    start = time.perf_counter()
    expected = example["raises"]
    try:
        run(example, dict(base))
        error = expected and f"it raised nothing; its marker says {expected}"
    except BaseException as raised:
        error = traceback.format_exc()
        if expected in [kind.__name__ for kind in type(raised).__mro__]:
            print(f"raised, as its marker says: {error.splitlines()[-1]}"[:300])
            error = None
    sys.stdout.flush()
    sys.stderr.flush()
    results[example["id"]] = {"error": error, "seconds": time.perf_counter() - start}
json.dump(results, open(out, "w"))
"""


def hook_names(code: str) -> list[str]:
    """The functions `code` defines where it is nothing but methods (each
    one's first parameter ``self``): a trainer's hooks. Else none."""
    body = ast.parse(code).body
    methods = [
        node.name
        for node in body
        if isinstance(node, ast.FunctionDef)
        and node.args.args
        and node.args.args[0].arg == "self"
    ]
    return methods if body and len(methods) == len(body) else []


def run_examples(
    examples: list[Example], folder: Path, preamble: str = PREAMBLE, fresh: str = FRESH
) -> tuple[dict[str, dict], str, str]:
    """Runs `examples` in one process, in `folder`: each one's outcome
    (error, seconds), and the process's stdout and stderr."""
    given = [
        {
            "id": e.id,
            "file": str(e.file),
            "line": e.line,
            "code": e.code,
            "raises": e.raises,
            "hooks": hook_names(e.code),
        }
        for e in examples
    ]
    (folder / "examples.json").write_text(
        json.dumps([preamble, fresh, given, str(folder / "outcomes.json")])
    )
    (folder / "run").mkdir()
    done = forkserver.run(
        [sys.executable, "-c", _RUNNER, str(folder / "examples.json")],
        cwd=folder / "run",
        env={
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": "8",
            "NPROC": "16",
            # The W&B example logs offline, into its own folder.
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
        },
        timeout=600,
    )
    assert done.returncode == 0, f"the examples' process failed:\n{done.stderr[-8000:]}"
    outcomes = json.loads((folder / "outcomes.json").read_text())
    return outcomes, done.stdout, done.stderr


def test_runner_checks_markers(tmp_path):
    # An example marked `raises` must raise that class (or a subclass); one
    # unmarked must raise nothing. No preamble: no JAX started.
    def example(line: int, code: str, raises: str | None = None) -> Example:
        return Example(SRC / "_example.py", line, "f", code, None, raises)

    examples = [
        example(1, "print('ran')"),
        example(2, "int('x')", raises="Exception"),
        example(3, "pass", raises="ValueError"),
        example(4, "int('x')", raises="KeyError"),
        example(5, "int('x')"),
    ]
    outcomes, stdout, _ = run_examples(examples, tmp_path, preamble="", fresh="")
    errors = [outcomes[e.id]["error"] for e in examples]
    assert errors[:2] == [None, None]
    assert errors[2] == "it raised nothing; its marker says ValueError"
    assert errors[3].endswith(
        "ValueError: invalid literal for int() with base 10: 'x'\n"
    )
    assert f'File "{SRC / "_example.py"}", line 4' in errors[3]  # the example's line
    assert errors[4].endswith("with base 10: 'x'\n")
    assert _output_of(stdout, examples[0].id) == "ran\n"
    assert hook_names("def loss(self, model, outputs, targets):\n    return outputs")
    assert not hook_names("def f(x):\n    return x")
    assert not hook_names("def loss(self):\n    pass\nloss(None)")


def _output_of(text: str, example_id: str) -> str:
    """The lines an example printed (to stdout or stderr): those after its
    header up to the next."""
    parts = re.split(r"^--- (\S+)\n", text, flags=re.M)
    return "".join(
        output
        for name, output in zip(parts[1::2], parts[2::2], strict=True)
        if name == example_id
    )


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict[str, dict]:
    """Runs the examples this session selected, all in one process: each
    one's error (None: it ran as it should), seconds and output."""
    selected = {
        item.callspec.params["example"].id
        for item in request.session.items
        if isinstance(
            getattr(item, "callspec", None) and item.callspec.params.get("example"),
            Example,
        )
    }
    runs = [e for e in EXAMPLES if e.skip is None and e.id in selected]
    outcomes, stdout, stderr = run_examples(runs, tmp_path_factory.mktemp("docstrings"))
    for example_id, outcome in outcomes.items():
        outcome["output"] = _output_of(stdout, example_id) + _output_of(
            stderr, example_id
        )
    return outcomes


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.id)
def test_docstring_example_runs(example, outcomes):
    if example.skip is not None:
        pytest.skip(f"{example.id} ({example.owner}): {example.skip}")
    result = outcomes[example.id]
    assert result["error"] is None, (
        f"the example of {example.owner} at {example.id} failed:\n{result['error']}\n"
        f"--- its output ---\n{result['output'][-3000:]}"
    )
    noise = third_party_lines(result["output"])
    assert not noise, f"{example.id} printed lines of other libraries: {noise}"
