"""The typed API: py.typed ships, pyright is clean on src/, and an IDE sees
the user's own model type through the trainer."""

import importlib.resources
import inspect
import json
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import phalanx as px


ROOT = Path(__file__).resolve().parent.parent


def test_py_typed_is_shipped():
    assert importlib.resources.files("phalanx").joinpath("py.typed").is_file()


def test_public_signatures_carry_shapes():
    for model in (px.models.MLP, px.models.Linear):
        call = inspect.signature(model.__call__)
        x, out = call.parameters["x"].annotation, call.return_annotation
        assert x.__name__.startswith("Float[") and x.dim_str == "in"
        assert out.__name__.startswith("Float[") and out.dim_str == "out"
    loss = str(inspect.signature(px.DataParallelTrainer.loss).return_annotation)
    assert "batch" in loss
    # predict: a pytree of NumPy or jax arrays sharing their leading rows, and
    # outputs with those rows.
    predict = inspect.signature(px.DataParallelTrainer.predict)
    leaves = typing.get_args(predict.parameters["x"].annotation.leaftype)
    assert [leaf.dim_str for leaf in leaves] == ["rows ...", "rows ..."]
    assert predict.return_annotation.leaftype.dim_str == "rows ..."


KERAS_CALLS = (
    "import jax, optax\n"
    "import numpy as np\n"
    "import phalanx as px\n"
    "m = px.models.Linear(3, 1, key=jax.random.key(0))\n"
    "t = px.DataParallelTrainer(m, optax.sgd(0.1))\n"
    "reveal_type(t.model)\n"
    "reveal_type(t.state)\n"
    "reveal_type(t.fit([]))\n"
    "x, y = np.zeros((4, 3), np.float32), np.zeros(4, np.int32)\n"
    "t.fit([(x, y)], epochs=1, eval_data=[(x, y)])\n"
    "t.evaluate([(x, y)])\n"
    # Keras' calls, each an error (lines 12 to 14):
    "t.fit(x, y)\n"
    "t.evaluate(x, y)\n"
    "t.fit([(x, y)], batch_size=128)\n"
)


@pytest.fixture(scope="module")
def pyright(tmp_path_factory) -> dict[str, str]:
    """pyright's report on users' files (KERAS_CALLS, USER_SUBCLASS and
    TYPED_HOOKS below), from one run (each run analyses phalanx anew; src/
    itself is checked by CI's own pyright step, and by the tooling before a
    commit: reporting on it here took 16 of this run's 19 CPU-seconds):
    for each, its diagnostics as pyright prints them, a line each
    (``FILE:LINE:COLUMN - SEVERITY: MESSAGE``), then its counts
    (``N errors, N warnings``)."""
    folder = tmp_path_factory.mktemp("usage")
    files = {
        "keras_calls": KERAS_CALLS,
        "user_subclass": USER_SUBCLASS,
        "typed_hooks": TYPED_HOOKS,
    }
    for name, code in files.items():
        (folder / f"{name}.py").write_text(code)
    exe = shutil.which("pyright") or str(Path(sys.executable).parent / "pyright")
    paths = {name: str(folder / f"{name}.py") for name in files}
    done = subprocess.run(
        [exe, "--outputjson", *paths.values()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    diagnostics = json.loads(done.stdout)["generalDiagnostics"]
    reports = {}
    for name, path in paths.items():
        mine = [d for d in diagnostics if d["file"].startswith(path)]
        lines = [
            f"{d['file']}:{d['range']['start']['line'] + 1}:"
            f"{d['range']['start']['character'] + 1} - {d['severity']}: "
            f"{d['message']}"
            for d in mine
        ]
        counts = [sum(d["severity"] == s for d in mine) for s in ("error", "warning")]
        lines.append(f"{counts[0]} errors, {counts[1]} warnings")
        reports[name] = "\n".join(lines)
    return reports


@pytest.mark.slow
def test_model_type_flows_through_the_trainer_and_keras_calls_are_errors(pyright):
    output = pyright["keras_calls"]
    assert 'Type of "t.model" is "Linear"' in output, output
    assert 'Type of "t.state" is "TrainState[Linear]"' in output, output
    errors = re.findall(r"keras_calls\.py:(\d+):\d+ - error", output)
    assert errors == ["12", "13", "14"], output
    assert "Expected 1 positional argument" in output, output
    assert 'No parameter named "batch_size"' in output, output


USER_SUBCLASS = """
import equinox as eqx
import jax
import optax
import phalanx as px


class Net(eqx.Module):
    layer: eqx.nn.Linear

    def __call__(self, x):
        return self.layer(x)


class NetTrainer(px.DataParallelTrainer[Net]):
    def loss(self, model, outputs, targets):
        reveal_type(model)
        return super().loss(model, outputs, targets)

    def gradients(self, grads, state):
        reveal_type(state.model)
        return grads


class Watch(px.Callback[Net]):
    def on_step_end(self, info):
        reveal_type(info.trainer.model)
        reveal_type(info.state.model)


net = Net(eqx.nn.Linear(2, 2, key=jax.random.key(0)))
trainer = NetTrainer(net, optax.adam(1e-3), callbacks=[Watch()])
reveal_type(trainer.predict(jax.numpy.zeros((3, 2))))
reveal_type(trainer.fit([]).model)
"""


@pytest.mark.slow
def test_a_subclass_sees_its_own_model_in_hooks_callbacks_and_predict(pyright):
    output = pyright["user_subclass"]
    for expression, shown in (
        ("model", "Net"),
        ("state.model", "Net"),
        ("info.trainer.model", "Net"),
        ("info.state.model", "Net"),
        ("trainer.predict(jax.numpy.zeros((3, 2)))", "Array"),
        ("trainer.fit([]).model", "Net"),
    ):
        assert f'Type of "{expression}" is "{shown}"' in output, output
    assert output.splitlines()[-1].startswith("0 errors,"), output


TYPED_HOOKS = """
import jax.numpy as jnp
from jaxtyping import Array, Float
import phalanx as px


class Plain(px.DataParallelTrainer):
    def loss(self, model, outputs, targets) -> Float[Array, " batch"]:
        return jnp.sum(outputs, axis=-1)

    def metrics(self, outputs, targets) -> dict[str, Float[Array, " batch"]]:
        return {"mean": jnp.mean(outputs, axis=-1)}


class WithValues(px.DataParallelTrainer):
    def loss(
        self, model, outputs, targets
    ) -> tuple[Float[Array, " batch"], dict[str, Float[Array, " batch"]]]:
        fit = jnp.sum(outputs, axis=-1)
        return fit, {"fit": fit}

    def metrics(self, outputs, targets) -> dict[str, px.metrics.Statistic]:
        return {"f1": px.metrics.f1(outputs, targets, num_classes=10)}


class Wrong(px.DataParallelTrainer):
    def loss(self, model, outputs, targets) -> float:
        return 0.0
"""


@pytest.mark.slow
def test_both_forms_of_the_loss_type_check_and_a_wrong_one_does_not(pyright):
    output = pyright["typed_hooks"]
    errors = re.findall(r"typed_hooks\.py:(\d+):\d+ - error: (.*)", output)
    assert [line for line, _ in errors] == ["27"], output
    assert "incompatible" in errors[0][1].lower(), output
