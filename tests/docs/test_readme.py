"""The command-line example with your own model module runs as written: its
`mymodels.py` block (from the README, else docs/guides/cli.md) is written to
a file and its `phalanx train` command runs. The other Python blocks of the
README and the docs run in test_docs.py. The README stays one page that
links every guide."""

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

import forkserver
from test_docs import python_blocks


ROOT = Path(__file__).resolve().parent.parent.parent
_EXAMPLE = re.compile(
    r"With `mymodels.py`:\n\n```python\n(.*?)```\n\n```bash\n(.*?)```", re.S
)


@pytest.mark.slow
def test_readme_own_model_on_the_command_line(tmp_path):
    pages = [ROOT / "README.md", ROOT / "docs" / "guides" / "cli.md"]
    matches = [_EXAMPLE.search(p.read_text()) for p in pages if p.exists()]
    match = next((m for m in matches if m), None)
    assert match, "neither the README nor docs/guides/cli.md has the example"
    (tmp_path / "mymodels.py").write_text(match.group(1))
    command = shlex.split(match.group(2).replace("\\\n", " "))
    assert command[:2] == ["phalanx", "train"]
    done = forkserver.run(
        [sys.executable, "-m", "phalanx", *command[1:], "--run-dir", "RUN"],
        cwd=tmp_path,
        env={**os.environ, "NPROC": "16", "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    accuracy = re.search(r"test accuracy (\d\.\d+)", done.stdout)
    assert accuracy and float(accuracy[1]) > 0.9, done.stdout


def test_readme_is_one_page_that_links_every_guide():
    # The README shows the product on at most 200 lines: each guide linked,
    # every Python block run by test_docs.py (none skipped).
    readme = ROOT / "README.md"
    text = readme.read_text()
    assert len(text.splitlines()) <= 200, len(text.splitlines())
    guides = sorted((ROOT / "docs" / "guides").glob("*.md"))
    unlinked = [g.name for g in guides if f"](docs/guides/{g.name}" not in text]
    assert guides and not unlinked, f"guides the README does not link: {unlinked}"
    blocks = python_blocks(readme)
    assert blocks and all(block.skip is None for block in blocks), blocks
