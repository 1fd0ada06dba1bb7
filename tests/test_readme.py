"""The README's "your own model and loss" example runs as written."""

import os
import re
import shlex
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


@pytest.mark.slow
def test_readme_own_model_on_the_command_line(tmp_path):
    readme = (ROOT / "README.md").read_text()
    match = re.search(
        r"With `mymodels.py`:\n\n```python\n(.*?)```\n\n```bash\n(.*?)```", readme, re.S
    )
    assert match, "README lost its command-line model example"
    (tmp_path / "mymodels.py").write_text(match.group(1))
    command = shlex.split(match.group(2).replace("\\\n", " "))
    assert command[:2] == ["phalanx", "train"]
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", *command[1:], "--run-dir", "RUN"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "NPROC": "16", "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    accuracy = re.search(r"test accuracy (\d\.\d+)", done.stdout)
    assert accuracy and float(accuracy[1]) > 0.9, done.stdout
