"""The README's "your own model and loss" example runs as written."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_readme_example_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    match = re.search(
        r"## Your own model and loss\n\n```python\n(.*?)```", readme, re.S
    )
    assert match, "README lost its example"
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    env = {**os.environ, "NPROC": os.environ.get("NPROC", "16")}
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("(5, 3)"), done.stdout
