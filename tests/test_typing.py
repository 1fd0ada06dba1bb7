"""The typed API: py.typed ships, pyright is clean on src/, and an IDE sees
the user's own model type through the trainer."""

import importlib.resources
import inspect
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx as px


ROOT = Path(__file__).resolve().parent.parent


def test_py_typed_is_shipped():
    assert importlib.resources.files("phalanx").joinpath("py.typed").is_file()


def test_public_signatures_carry_shapes():
    annotation = str(
        inspect.signature(px.models.MLP.__call__).parameters["x"].annotation
    )
    assert "Float" in annotation and "in" in annotation
    loss = str(inspect.signature(px.DataParallelTrainer.loss).return_annotation)
    assert "batch" in loss


def pyright(*args: str) -> str:
    exe = shutil.which("pyright") or str(Path(sys.executable).parent / "pyright")
    done = subprocess.run(
        [exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    return done.stdout + done.stderr


@pytest.mark.slow
def test_pyright_clean_on_src():
    output = pyright("src")
    assert "0 errors, 0 warnings" in output, output


@pytest.mark.slow
def test_model_type_flows_through_the_trainer(tmp_path):
    usage = tmp_path / "usage.py"
    usage.write_text(
        "import jax, optax\n"
        "import phalanx as px\n"
        "m = px.models.Linear(3, 1, key=jax.random.key(0))\n"
        "t = px.DataParallelTrainer(m, optax.sgd(0.1))\n"
        "reveal_type(t.model)\n"
        "reveal_type(t.state)\n"
        "reveal_type(t.fit([]))\n"
    )
    output = pyright(str(usage))
    assert 'Type of "t.model" is "Linear"' in output, output
    assert 'Type of "t.state" is "TrainState[Linear]"' in output, output
    assert "0 errors" in output, output
