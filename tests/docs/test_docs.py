"""The documentation site stays honest: it builds with no broken link or
cross-reference, its API reference has an entry for every public name and a
link for every type alias, every Python block of the README and of docs/
runs, quietly, and every trainer subclass the guides and examples show is
typed by its model.

A Python block is run unless the line before it (blank lines aside) is
``<!-- skip: REASON -->``, e.g. ``<!-- skip: needs a GPU -->``. The blocks of
one file run in order in one fresh process and share one namespace, as if
they were one script, in an empty temporary folder, on 8 CPU devices
(``JAX_PLATFORMS=cpu``, ``JAX_NUM_CPU_DEVICES=8``, ``NPROC=16``), with
logging configured as a user would; no line of another library (absl,
orbax, TensorStore, gloo, a Python warning) may appear in their output.
"""

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

import pytest

import forkserver


ROOT = Path(__file__).resolve().parent.parent.parent
SRC = ROOT / "src" / "phalanx"
DOCS = ROOT / "docs"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

# --- the site builds ----------------------------------------------------------


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    api = tmp_path / "site" / "api" / "phalanx" / "index.html"
    assert api.exists()
    # Each type alias a signature names (`loss: LossName | LossFn`) links to
    # its row of the table on phalanx's API page, never to a private module.
    aliases = docs_aliases().private_type_aliases()
    pages = {p: p.read_text() for p in (tmp_path / "site").rglob("*.html")}
    unlinked = sorted(
        {
            identifier
            for text in pages.values()
            for identifier in re.findall(r'<span title="(phalanx\.[\w.]+)">', text)
            if identifier in aliases
        }
    )
    assert not unlinked, f"type aliases with no link in the API reference: {unlinked}"
    private = sorted(
        {
            target
            for text in pages.values()
            for target in re.findall(r'href="([^"]*#phalanx\._[^"]*)"', text)
        }
    )
    assert not private, f"links to private modules: {private}"
    for name in ("LossName", "ChecksMode", "NanPolicy", "PrecisionName"):
        assert f'href="#{name}"' in pages[api], name  # the signature's link
        assert f'<code id="{name}">{name}</code>' in pages[api], name  # its row


def docs_aliases() -> Any:
    """scripts/docs_aliases.py, the site's mkdocs hook, as a module."""
    spec = importlib.util.spec_from_file_location(
        "docs_aliases", ROOT / "scripts" / "docs_aliases.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trainer_attributes_are_documented():
    # What users and callbacks read of a trainer has an entry in the API
    # reference: an attribute docstring that mkdocstrings (griffe) finds.
    griffe = pytest.importorskip("griffe")
    package = griffe.load("phalanx", search_paths=[str(SRC.parent)])
    trainer = package["DataParallelTrainer"]
    for name in ("history", "stop_training", "strategy"):
        member = trainer.members[name]
        assert member.docstring is not None and member.docstring.value, name


# --- every public name has an API entry ---------------------------------------


def _reexports(init: Path, package: str) -> dict[str, str | None]:
    """The public names of a package's `__init__` (stub), each mapped to the
    public path it is re-exported from (None: defined in a private module)."""
    names: dict[str, str | None] = {}
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                name = alias.asname or alias.name
                if name.startswith("_"):
                    continue
                source = f"{module}.{alias.name}"
                private = any(part.startswith("_") for part in source.split("."))
                names[name] = None if private else source
        elif isinstance(node, ast.ClassDef | ast.FunctionDef):
            if not node.name.startswith("_"):
                names[node.name] = None
    return names


def public_names() -> dict[str, set[str]]:
    """Each public name (`phalanx.X`, `phalanx.sub.X`, not the subpackages
    themselves) and the paths it may be documented by: its own, or the
    public one it is re-exported from."""
    packages = {"phalanx": SRC / "__init__.pyi"}
    for init in sorted(SRC.glob("*/__init__.py")):
        if not init.parent.name.startswith("_"):
            stub = init.with_suffix(".pyi")  # a lazy package's list of names
            packages[f"phalanx.{init.parent.name}"] = stub if stub.exists() else init
    paths: dict[str, set[str]] = {}
    for package, init in packages.items():
        for name, source in _reexports(init, package).items():
            if source in packages:  # a subpackage: its own page
                continue
            path = f"{package}.{name}"
            paths[path] = {path} if source is None else {path, source}
    return paths


def api_entries() -> list[str]:
    return [
        match[1]
        for page in sorted((DOCS / "api").glob("*.md"))
        for match in re.finditer(r"^:::\s+(\S+)", page.read_text(), re.M)
    ]


def test_every_public_name_has_an_api_entry():
    names = public_names()
    entries = api_entries()
    assert "phalanx.DataParallelTrainer" in names  # the parse found the stub
    assert "phalanx.strategies.ShardingStrategy" in names["phalanx.ShardingStrategy"]
    missing = sorted(name for name, paths in names.items() if not paths & set(entries))
    assert not missing, f"public names with no `::: ...` entry in docs/api: {missing}"
    known = set().union(*names.values())
    stray = sorted(set(entries) - known)
    assert not stray, f"docs/api entries that are no public path: {stray}"
    twice = sorted(e for e in set(entries) if entries.count(e) > 1) + sorted(
        name for name, paths in names.items() if len(paths & set(entries)) > 1
    )
    assert not twice, f"documented more than once (keep one entry): {twice}"
    top_level = (DOCS / "api" / "phalanx.md").read_text()
    unlisted = sorted(
        name
        for name, paths in names.items()
        if name.count(".") == 1 and len(paths) > 1 and f"`{name}`" not in top_level
    )
    assert not unlisted, f"docs/api/phalanx.md does not list the aliases {unlisted}"
    for module in {name.rsplit(".", 1)[0] for name in names} - {"phalanx"}:
        page = DOCS / "api" / f"{module.removeprefix('phalanx.')}.md"
        assert page.exists(), f"{module} has no API page {page}"


# --- every Python block runs --------------------------------------------------

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)\s*(?P<info>[^\n]*)$")
_SKIP = re.compile(r"^\s*<!--\s*skip\b(?P<colon>:?)(?P<reason>.*?)-->\s*$")


class Block(NamedTuple):
    line: int  # of its first code line, 1-based
    code: str  # dedented
    skip: str | None  # the reason it is not run; None: it runs
    skip_line: int | None  # the line of its skip comment


def python_blocks(path: Path) -> list[Block]:
    """Each fenced Python block of a Markdown file. Raises ValueError for a
    skip comment with no reason."""
    lines = path.read_text().splitlines()
    blocks = []
    previous = 0  # the last non-blank line outside a block, 1-based
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            if lines[i].strip():
                previous = i + 1
            i += 1
            continue
        fence = opening["fence"]
        end = i + 1
        while end < len(lines) and not re.match(
            rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]
        ):
            end += 1
        language = (opening["info"].split() or [""])[0].lstrip(".{").lower()
        if language == "python":
            skip = _SKIP.match(lines[previous - 1]) if previous else None
            reason = skip["reason"].strip() if skip else None
            if skip and not (skip["colon"] and reason):
                raise ValueError(
                    f"{path}:{previous}: a skipped block needs a reason: "
                    "<!-- skip: needs a GPU -->"
                )
            code = textwrap.dedent("\n".join(lines[i + 1 : end]))
            blocks.append(Block(i + 2, code, reason, previous if skip else None))
        previous = end + 1
        i = end + 1
    return blocks


def _has_python(path: Path) -> bool:
    return re.search(r"^[ \t]*```+\s*python\b", path.read_text(), re.M) is not None


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


# Runs the blocks of one file in one namespace. Each block is compiled as the
# Markdown file with its code at its own lines, so a traceback names the file
# and shows the line of the failing code. Every log record that reaches the
# root logger (any library's, at WARNING and above: phalanx's own logger has
# a handler of its own) and every Python warning is printed as
# `LEVEL:logger:message`, as `logging.basicConfig` would: a record no handler
# would have shown still counts, since a user who configures logging sees it.
_RUNNER = """
import json, logging, sys, traceback
logging.basicConfig(level=logging.WARNING, format="%(levelname)s:%(name)s:%(message)s")
logging.captureWarnings(True)
source, path, blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for line, code in blocks:
    print(f"--- {path}:{line}", flush=True)
    try:
        exec(compile("\\n" * (line - 1) + code, source, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"the block at {path}:{line} failed", file=sys.stderr)
        sys.exit(1)
"""

# A line of output that is not phalanx's nor the page's own: a log record of
# another logger (absl, orbax, jax, py.warnings, ...), printed by the runner;
# a C++ log line in glog's format (XLA, TensorStore, gloo:
# "W0612 10:00:00.123456  1234 file.cc:12] ..."); gloo's own "[Gloo] ...";
# absl's C++ preamble ("WARNING: All log messages before
# absl::InitializeLog() is called are written to STDERR").
_THIRD_PARTY = re.compile(
    r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):(?!phalanx[.:])"
    r"|[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\]"
    r"|\[Gloo\]"
)


def third_party_lines(output: str) -> list[str]:
    """The lines of `output` that another library printed."""
    return [line for line in output.splitlines() if _THIRD_PARTY.match(line)]


def test_skipped_blocks_have_a_reason():
    for path in MARKDOWN:
        used = {block.skip_line for block in python_blocks(path)}  # raises
        fence = None  # the fence of the code block we are in
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if opening := _FENCE.match(line):
                if fence is None:
                    fence = opening["fence"]
                elif opening["fence"].startswith(fence) and not opening["info"]:
                    fence = None
            elif fence is None and re.match(r"\s*<!--\s*skip", line):
                assert _SKIP.match(line) and number in used, (
                    f"{_name(path)}:{number}: {line.strip()!r}: a skip comment "
                    "is `<!-- skip: REASON -->` on the line right before the "
                    "```python block it skips"
                )


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in MARKDOWN if _has_python(p)], ids=_name)
def test_python_blocks_run(path, tmp_path):
    blocks = [(b.line, b.code) for b in python_blocks(path) if b.skip is None]
    if not blocks:
        return
    (tmp_path / "blocks.json").write_text(json.dumps([str(path), _name(path), blocks]))
    (tmp_path / "run").mkdir()
    done = forkserver.run(
        [sys.executable, "-c", _RUNNER, str(tmp_path / "blocks.json")],
        cwd=tmp_path / "run",
        env={
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": "8",
            "NPROC": "16",
        },
        timeout=600,
    )
    if done.returncode != 0:
        pytest.fail(
            f"{done.stderr[-8000:]}\n--- its output ---\n{done.stdout[-2000:]}",
            pytrace=False,
        )
    # Quiet by default (docs/architecture.md, "The rules"): a documented
    # pattern prints what the page and phalanx print, nothing of orbax, absl,
    # TensorStore, gloo or another library's.
    noise = third_party_lines(done.stdout + done.stderr)
    assert not noise, f"{_name(path)} printed lines of other libraries: {noise}"


def test_third_party_lines_are_found(tmp_path):
    # The runner makes every library's log record and Python warning a line
    # the check above finds, whether or not the library set up a handler.
    blocks = [
        (1, "import logging, warnings\nprint('a page prints this')"),
        (3, "logging.getLogger('absl').warning('Requested `tracked_metric`')"),
        (4, "logging.getLogger('phalanx').info('phalanx: its own line')"),
        (5, "warnings.warn('deprecated', DeprecationWarning)"),
        (
            6,
            "import sys; print('W0612 10:00:00.123456  1234 gloo.cc:12] slow', "
            "file=sys.stderr); print('[Gloo] Rank 0 is connected', file=sys.stderr)",
        ),
    ]
    (tmp_path / "blocks.json").write_text(json.dumps(["page.md", "page.md", blocks]))
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(tmp_path / "blocks.json")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    noise = third_party_lines(done.stdout + done.stderr)
    assert noise[0] == "WARNING:absl:Requested `tracked_metric`"
    assert noise[1].startswith("WARNING:py.warnings:") and "deprecated" in noise[1]
    assert noise[2:] == [
        "W0612 10:00:00.123456  1234 gloo.cc:12] slow",
        "[Gloo] Rank 0 is connected",
    ]
    assert not third_party_lines("--- page.md:1\na page prints this\nphalanx: x\n")


# --- the guides' trainers are typed -------------------------------------------
#
# A subclass written `class MyTrainer(px.DataParallelTrainer[MyModel])` gets
# `model: MyModel` in its hooks from pyright (and an IDE); written without the
# subscript, `model` is Unknown there. pyright runs once over every page that
# defines a subclass (its blocks at their own lines) and every example, each
# with `reveal_type` lines appended for its subclasses.

EXAMPLES = ROOT / "examples"
# The hook parameters typed by the trainer's model: `loss(model, ...)`,
# `gradients(grads, state: TrainState[MyModel])`.
_TYPED_PARAMETERS = ("model", "state")


def _is_trainer(base: ast.expr, trainers: set[str]) -> bool:
    target = base.value if isinstance(base, ast.Subscript) else base
    if isinstance(target, ast.Attribute):
        return target.attr == "DataParallelTrainer"
    return isinstance(target, ast.Name) and (
        target.id == "DataParallelTrainer" or target.id in trainers
    )


def trainer_classes(source: str) -> dict[str, list[str]]:
    """The `DataParallelTrainer` subclasses a module defines at its top level
    (directly, or through another of them), each with its methods that take
    a parameter the trainer's model types."""
    classes: dict[str, list[str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and any(
            _is_trainer(base, set(classes)) for base in node.bases
        ):
            classes[node.name] = [
                method.name
                for method in node.body
                if isinstance(method, ast.FunctionDef)
                and {a.arg for a in method.args.args} & set(_TYPED_PARAMETERS)
            ]
    return classes


def _reveals(classes: dict[str, list[str]]) -> str:
    lines = [""]
    for name, methods in classes.items():
        lines += [
            f"def _reveal_{name}(trainer: {name}) -> None:",
            "    reveal_type(trainer.model)",
            "",
        ]
        lines += [f"reveal_type({name}.{method})" for method in methods]
    return "\n".join(lines) + "\n"


def _page_source(path: Path) -> str:
    """Every Python block of a page (skipped ones too: they are read, not
    run), each at its own lines of the Markdown file."""
    lines: list[str] = []
    for block in python_blocks(path):
        lines += [""] * (block.line - 1 - len(lines))
        lines += block.code.splitlines()
    return "\n".join(lines) + "\n"


def _pyright_reveals(files: list[Path]) -> dict[Path, list[str]]:
    """The types pyright reveals in `files` (run with the project's config),
    each file's in order."""
    exe = shutil.which("pyright") or str(Path(sys.executable).parent / "pyright")
    done = subprocess.run(
        [exe, "--outputjson", *map(str, files)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(done.stdout)
    reveals: dict[Path, list[str]] = {file: [] for file in files}
    for diagnostic in report["generalDiagnostics"]:
        if diagnostic["message"].startswith("Type of "):
            reveals[Path(diagnostic["file"])].append(diagnostic["message"])
    return reveals


def _unknowns(reveal: str) -> list[str]:
    """What a reveal shows untyped: the model Unknown (`Type of
    "trainer.model" is "Unknown"`), or a hook's model or state parameter."""
    shown = reveal.split(" is ", 1)[1]
    if reveal.startswith('Type of "trainer.model"'):
        return [shown] if "Unknown" in shown else []
    return [
        f"{name}: {match}"
        for name in _TYPED_PARAMETERS
        for match in re.findall(rf"\b{name}: ([\w.]+(?:\[[^\]]*\])?)", shown)
        if "Unknown" in match
    ]


@pytest.mark.slow
def test_trainer_subclasses_are_typed(tmp_path):
    sources = {_name(p): _page_source(p) for p in MARKDOWN if _has_python(p)}
    sources |= {_name(p): p.read_text() for p in sorted(EXAMPLES.glob("*.py"))}
    # The examples as they are, so that those importing each other resolve
    # as when run; beside them, each checked file with its reveals.
    for example in EXAMPLES.glob("*.py"):
        (tmp_path / example.name).write_text(example.read_text())
    files: dict[Path, tuple[str, dict[str, list[str]]]] = {}
    for name, source in sources.items():
        classes = trainer_classes(source)
        if classes:
            file = tmp_path / ("checked_" + re.sub(r"\W", "_", name) + ".py")
            file.write_text(source + _reveals(classes))
            files[file.resolve()] = (name, classes)
    # The pages that define subclasses (the guides to models, strategies,
    # coming from Lightning) and examples/collectives.py.
    assert len(files) >= 4, sorted(name for name, _ in files.values())
    reveals = _pyright_reveals(list(files))
    for file, (name, classes) in files.items():
        expected = len(classes) + sum(map(len, classes.values()))
        shown = reveals[file][-expected:]
        assert len(shown) == expected, (name, reveals[file])
        untyped = [(reveal, u) for reveal in shown for u in _unknowns(reveal)]
        assert not untyped, (
            f"{name}: pyright cannot type the model of a trainer subclass; "
            f"write `class MyTrainer(px.DataParallelTrainer[MyModel])`: {untyped}"
        )
