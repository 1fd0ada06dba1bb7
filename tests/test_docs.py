"""The documentation site stays honest: it builds with no broken link or
cross-reference, its API reference has an entry for every public name, and
every Python block of the README and of docs/ runs.

A Python block is run unless the line before it (blank lines aside) is
``<!-- skip: REASON -->``, e.g. ``<!-- skip: needs a GPU -->``. The blocks of
one file run in order in one fresh process and share one namespace, as if
they were one script, in an empty temporary folder, on 8 CPU devices
(``JAX_PLATFORMS=cpu``, ``JAX_NUM_CPU_DEVICES=8``, ``NPROC=16``).
"""

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest


ROOT = Path(__file__).resolve().parent.parent
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
    assert (tmp_path / "site" / "api" / "phalanx" / "index.html").exists()


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
            packages[f"phalanx.{init.parent.name}"] = init
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
# and shows the line of the failing code.
_RUNNER = """
import json, sys, traceback
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


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory) -> dict[str, str]:
    """The files' blocks compile many of the same programs: one persistent
    compilation cache for all of them."""
    return {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax-cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in MARKDOWN if _has_python(p)], ids=_name)
def test_python_blocks_run(path, tmp_path, compilation_cache):
    blocks = [(b.line, b.code) for b in python_blocks(path) if b.skip is None]
    if not blocks:
        return
    (tmp_path / "blocks.json").write_text(json.dumps([str(path), _name(path), blocks]))
    (tmp_path / "run").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(tmp_path / "blocks.json")],
        cwd=tmp_path / "run",
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": "8",
            "NPROC": "16",
            **compilation_cache,
        },
        timeout=600,
    )
    if done.returncode != 0:
        pytest.fail(
            f"{done.stderr[-8000:]}\n--- its output ---\n{done.stdout[-2000:]}",
            pytrace=False,
        )
