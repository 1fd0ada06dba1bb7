"""What a callback declares on `px.Callback` instead of being probed for it
(its monitors, the metrics it adds, whether it is called after each step),
and its state in checkpoints, keyed by `state_key`: stable when callbacks
are reordered, added or dropped, refused where two would share a key, and
read from checkpoints keyed the old way ("<index>:<ClassName>")."""

import ast
import dataclasses
import pathlib

import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model


SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "phalanx"

# The getattr/hasattr calls in src/ and what they read: none discovers what a
# callback or a display can do (that is declared on `Callback`). Keyed by the
# object's and the attribute's source text, so that moving code keeps them.
UNRELATED = {
    ("jaxtyping", "prefix[kind] + bits"): "a jaxtyping dtype class, by name",
    ("labels", "'dtype'"): "an error message names the labels' dtype, if any",
    ("model", "'in_size'"): "a user's model's optional width, for a hint",
    ("model", "'fit'"): "an error message tells a trainer from a model",
    ("module", "field.name"): "the fields of a user's strategy, for its config",
    ("tree", "'_fields'"): "an optax state is a namedtuple",
    ("unraisable.object", "'cr_code'"): "a coroutine in Python's unraisable hook",
    ("previous", "'__name__'"): "an unraisable hook installed twice",
    ("self", "field.name"): "a dataclass's own fields",
    ("module", "name"): "a user's model class, by the name the CLI was given",
    ("value", "'exit_code'"): "the exit code of a preempted process",
    ("px_metrics", "name"): "a px.metrics function named in a call's error",
    ("function", "'__qualname__'"): "that the name is px.metrics' own function",
    ("leaf", "'sharding'"): "a batch leaf's layout, where it is a device array",
    ("sharding", "'spec'"): "a layout's spec in a message, where it has one",
    ("s", "'memory_kind'"): "whether a layout keeps a leaf in host memory",
    ("sharding", "'memory_kind'"): "whether a layout keeps a leaf in host memory",
    ("devices[0]", "'memory_stats'"): "a device's memory limit, where JAX has one",
    ("x", "'shape'"): "a planned batch's leaves: arrays or their shapes",
    ("x", "'dtype'"): "a planned batch's leaves: arrays or their shapes",
    ("stats", "'host_argument_size_in_bytes'"): "XLA's host memory, where reported",
    ("remat", "'__name__'"): "a checkpoint policy's name in the plan's table",
    ("node", "'remat'"): "a stack of phalanx's own Stacked (its remat field)",
    ("sys", "'ps1'"): "whether Python runs interactively (the hang watchdog's auto)",
    ("st", "strategy"): "a registered strategy's class, by name, from the lazily "
    "imported strategies (the registry imports no JAX)",
    ("record", "MARK"): "a log record the plan's progress marked (logging's "
    "`extra=` sets attributes on records)",
}


def probes() -> list[tuple[str, int, str, tuple[str, str]]]:
    """Every getattr/hasattr call in src/: file, line, function, and the
    source of its object and attribute."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                args = tuple(ast.unparse(arg) for arg in node.args[:2])
                where = str(path.relative_to(SRC))
                found.append((where, node.lineno, node.func.id, (args[0], args[1])))
    return found


def test_no_capability_is_probed_for():
    unknown = [probe for probe in probes() if probe[3] not in UNRELATED]
    assert unknown == [], (
        "getattr/hasattr in src/: a callback or display declares what it can "
        "do on px.Callback; list an unrelated use in UNRELATED, with why"
    )


def test_no_module_name_is_tested():
    # Which module defined a class says nothing of what it can do. (An
    # assignment, setting the module an error shows, is no test.)
    reads = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for path in sorted(SRC.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr == "__module__"
        and isinstance(node.ctx, ast.Load)
    ]
    assert reads == []


def test_the_probe_finder_finds_probes():
    tree = ast.parse("getattr(callback, 'monitor', None)\nhasattr(display, 'x')")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    assert [ast.unparse(c.args[0]) for c in calls] == ["callback", "display"]
    assert ("callback", "'monitor'") not in UNRELATED


# --- declared capabilities ----------------------------------------------------


def batches(n: int = 4, size: int = 16):
    x, y = make_data(n * size)
    return [(x[i : i + size], y[i : i + size]) for i in range(0, n * size, size)]


def trainer_of(callbacks, **kwargs) -> px.DataParallelTrainer:
    return px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=callbacks, progress=False, **kwargs
    )


class Steps(px.Callback):
    """Counts the steps it is called after, and keeps the count in checkpoints."""

    def __init__(self, *, needs_steps: bool = True):
        self.steps = 0
        self._needs_steps = needs_steps

    @property
    @override
    def needs_steps(self) -> bool:
        return self._needs_steps

    @override
    def on_step_end(self, info: px.StepInfo) -> None:
        self.steps += 1

    @override
    def state_dict(self):
        return {"steps": self.steps}

    @override
    def load_state_dict(self, state):
        self.steps = state["steps"]


def test_defaults_declare_nothing():
    callback = px.Callback()
    assert callback.monitors() == ()
    assert callback.added_metrics() is None
    assert not callback.needs_steps  # it does nothing after a step
    assert callback.state_key == "Callback"
    assert Steps().needs_steps
    assert px.callbacks.EarlyStopping("loss").monitors() == ("loss",)
    assert px.callbacks.LearningRateMonitor(0.1, name="rate").added_metrics() == (
        "rate",
    )


def test_a_callback_declining_steps_is_not_called_after_them():
    quiet, counted = Steps(needs_steps=False), Steps()
    quiet.state_name = "quiet"
    trainer_of([quiet, counted]).fit(batches(), steps=3)
    assert (quiet.steps, counted.steps) == (0, 3)


class Watches(px.Callback):
    """Reads a metric of its own choosing at epoch ends, and declares it."""

    def __init__(self, metric: str):
        self.metric = metric
        self.values = []

    @override
    def monitors(self) -> tuple[str, ...]:
        return (self.metric,)

    @override
    def on_epoch_end(self, info: px.StepInfo) -> None:
        self.values.append(info.metrics.get(self.metric))


class AddsScore(px.Callback):
    """Adds "score" at epoch ends; declares it where `declared`."""

    def __init__(self, *, declared: bool):
        self.declared = declared

    @override
    def added_metrics(self) -> tuple[str, ...] | None:
        return ("score",) if self.declared else None

    @override
    def on_epoch_end(self, info: px.StepInfo) -> None:
        info.metrics["score"] = 1.0


def test_a_declared_monitor_is_checked_against_what_callbacks_declare():
    with pytest.raises(ValueError, match=r"Watches\(monitor='scroe'\).*'score'"):
        trainer_of([AddsScore(declared=True), Watches("scroe")]).fit(batches())
    # Declared by the callback before it: produced. Undeclared: on trust.
    watches = Watches("score")
    trainer_of([AddsScore(declared=True), watches]).fit(batches())
    trusted = Watches("anything")
    trainer_of([AddsScore(declared=False), trusted]).fit(batches())
    assert (watches.values, trusted.values) == ([1.0], [None])


# --- state keys ---------------------------------------------------------------


def test_state_survives_reordering_the_callbacks(tmp_path):
    def run(order, *, steps):
        # The highest loss is the best: the first epoch's, so the stopper's
        # count after a resume is right only if its state was restored.
        named = {
            "counter": Steps(),
            "stopper": px.callbacks.EarlyStopping("loss", mode="max", patience=99),
            "checkpoint": px.callbacks.Checkpoint(tmp_path),
        }
        trainer = trainer_of([named[name] for name in order])
        resume = "latest" if "checkpoint" in order else None
        trainer.fit(batches(), steps=steps, resume=resume)
        return trainer, named["counter"], named["stopper"]

    _, straight, reference = run(["counter", "stopper"], steps=16)
    run(["counter", "stopper", "checkpoint"], steps=8)
    # Reordered (the checkpoint first: it still runs last), two epochs more.
    trainer, counter, stopper = run(["checkpoint", "stopper", "counter"], steps=16)
    assert int(trainer.state.step) == 16
    assert counter.steps == straight.steps == 16  # 8 restored, 8 made
    assert reference.state_dict()["best_epoch"] < 2  # before the resume
    assert stopper.state_dict() == reference.state_dict()


def test_two_stateful_callbacks_with_one_key_are_refused():
    with pytest.raises(ValueError) as info:
        trainer_of([Steps(), px.callbacks.EarlyStopping("loss"), Steps()])
    message = str(info.value)
    assert "callbacks[0] and callbacks[2]" in message, message
    assert "state_key='Steps'" in message, message
    assert "callbacks[2].state_name = 'second'" in message, message
    # Named apart, they are accepted, and so is a stateless pair.
    second = Steps()
    second.state_name = "second"
    trainer = trainer_of([Steps(), second, px.Callback(), px.Callback()])
    assert second.state_key == "Steps:second"
    with pytest.raises(ValueError, match=r"callbacks\[0\] and callbacks\[1\]"):
        trainer.callbacks = [Steps(), Steps()]  # the setter checks too
    counter = Steps()
    with pytest.raises(ValueError, match="are the same Steps; pass it once"):
        trainer_of([counter, counter])


def test_a_state_name_must_be_a_str():
    counter = Steps()
    counter.state_name = 3  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(TypeError, match=r"callbacks\[0\].state_name=3 must be a str"):
        trainer_of([counter])


def restored(states: dict, callbacks: list[px.Callback]) -> None:
    """Restore a fresh trainer's snapshot holding `states` into `callbacks`."""
    trainer = trainer_of(callbacks)
    trainer.restore(dataclasses.replace(trainer.snapshot(), callbacks=states))


def test_old_checkpoints_keyed_by_index_still_load():
    # One state and one callback of its class: matched by class, wherever it is.
    counter, stopper = Steps(), px.callbacks.EarlyStopping("loss")
    old = {
        "0:EarlyStopping": {**stopper.state_dict(), "wait": 2},
        "1:Steps": {"steps": 5},
    }
    restored(old, [counter, stopper])
    assert (counter.steps, stopper.wait) == (5, 2)
    # Two of a class: by index, as they were written.
    first, second = Steps(), Steps()
    second.state_name = "b"
    restored({"0:Steps": {"steps": 1}, "1:Steps": {"steps": 2}}, [first, second])
    assert (first.steps, second.steps) == (1, 2)


def test_a_state_no_callback_takes_is_reported(capsys):
    counter = Steps()
    restored({"Steps": {"steps": 4}, "Gone:old": {"x": 1}}, [counter])
    assert counter.steps == 4
    err = capsys.readouterr().err
    assert "phalanx: the checkpoint holds the state of callbacks" in err, err
    assert "'Gone:old'" in err and "'Steps'" not in err, err
