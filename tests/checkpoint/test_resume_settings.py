"""The settings that shape every update are part of a run: a resume (from a
checkpoint or a snapshot) with another ``ema``, ``precision``, ``loss``,
``param_groups`` or learning rate is refused in one line naming the
setting, before anything is restored; settings that change no update (the
strategy, steps per call) may change; a checkpoint written before settings
were kept resumes."""

import json
import shutil

import equinox as eqx
import optax
import pytest

import phalanx as px
from helpers import make_data, make_model, max_abs_diff


BATCHES = [make_data(16, seed=s) for s in range(2)]


def trainer(*callbacks, **options) -> px.DataParallelTrainer:
    return px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=callbacks, progress=False, **options
    )


class Grouped(px.DataParallelTrainer[px.models.MLP]):
    """The MLP's first layer in one group, the rest (its last) in another;
    with `swapped`, the other way round."""

    def __init__(self, *args, swapped: bool = False, **options):
        self.swapped = swapped
        super().__init__(*args, **options)

    def param_groups(self, model):
        first, last = ("head", "body") if self.swapped else ("body", "head")
        return eqx.tree_at(lambda m: m.layers, model, (first, last))


def grouped(*callbacks, swapped: bool = False) -> px.DataParallelTrainer:
    return Grouped(
        make_model(),
        {"body": optax.adam(1e-2), "head": optax.sgd(1e-1)},
        callbacks=callbacks,
        progress=False,
        swapped=swapped,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoint folders of a run with ema=0.9 and of a grouped run (each
    saved at step 2)."""
    folders = {}
    for name, make in (
        ("ema", lambda c: trainer(c, ema=0.9)),
        ("groups", lambda c: grouped(c)),
    ):
        folder = tmp_path_factory.mktemp(name)
        make(px.callbacks.Checkpoint(folder)).fit(BATCHES, epochs=1)
        folders[name] = folder
    return folders


def refusal(folder, what: str, fix: str) -> str:
    return (
        f"checkpoint {folder}/2 is of a run with {fix}, but this trainer has {what}: "
        "resumed, every update from there on would be another run's; build the "
        f"trainer with {fix} to continue that run, or start a new run without resume"
    )


@pytest.mark.parametrize(
    ("options", "what", "fix"),
    [
        ({"ema": 0.99}, "ema=0.99", "ema=0.9"),
        ({}, "ema=None", "ema=0.9"),
        ({"ema": 0.9, "precision": "bf16"}, "precision='bf16'", "precision='fp32'"),
        ({"ema": 0.9, "loss": "mse"}, "loss='mse'", "loss='cross_entropy'"),
    ],
)
def test_a_resume_that_changes_updates_is_refused(saved, options, what, fix):
    changed = trainer(**options)
    with pytest.raises(ValueError) as refused:
        changed.fit(BATCHES, epochs=2, resume=saved["ema"] / "2")
    assert str(refused.value) == refusal(saved["ema"], what, fix)
    assert changed.progress.step == 0  # nothing was restored


def test_another_learning_rate_is_refused(saved):
    slower = px.DataParallelTrainer(
        make_model(), optax.adam(1e-3), ema=0.9, progress=False
    )
    with pytest.raises(ValueError) as refused:
        slower.fit(BATCHES, epochs=2, resume=saved["ema"] / "2")
    assert str(refused.value) == refusal(
        saved["ema"],
        "an optimizer whose first update's learning rate is 0.001",
        "an optimizer whose first update's learning rate is 0.01",
    )


def test_changed_parameter_groups_are_refused(saved):
    folder = saved["groups"] / "2"
    with pytest.raises(ValueError) as swapped:
        grouped(swapped=True).fit(BATCHES, epochs=2, resume=folder)
    assert str(swapped.value) == refusal(
        saved["groups"],
        "param_groups putting model.layers[0].weight in group 'head'",
        "param_groups putting model.layers[0].weight in group 'body'",
    )
    with pytest.raises(ValueError) as one:  # one optimizer for every parameter
        trainer().fit(BATCHES, epochs=2, resume=folder)
    assert str(one.value) == refusal(
        saved["groups"],
        "one optimizer for every parameter",
        "the parameter groups ['body', 'head']",
    )


def test_a_snapshot_of_another_setting_is_refused():
    first = trainer(ema=0.9)
    first.fit(BATCHES, epochs=1)
    second = trainer(ema=0.5)
    with pytest.raises(ValueError, match=r"^snapshot is of a run with ema=0\.9, but "):
        second.restore(first.snapshot())
    assert second.progress.step == 0


def test_settings_that_change_no_update_may_change(saved, capsys):
    straight = trainer(ema=0.9)
    straight.fit(BATCHES, epochs=2)
    resumed = trainer(ema=0.9, strategy=px.PmapStrategy(8), steps_per_call=2)
    resumed.fit(BATCHES, epochs=2, resume=saved["ema"] / "2")
    assert max_abs_diff(resumed.model, straight.model) <= 1e-6
    assert capsys.readouterr().err.splitlines() == [
        f"phalanx: resumed from step 2 (epoch 2) of {saved['ema']}/2"
    ]


def test_a_checkpoint_without_settings_resumes(saved, tmp_path):
    # Written before settings were kept: nothing to compare, as before.
    folder = tmp_path / "old"
    shutil.copytree(saved["ema"], folder)
    metadata = folder / "2" / "host" / "metadata"
    host = json.loads(metadata.read_text())
    del host["settings"], host["eval_data"]
    metadata.write_text(json.dumps(host))
    resumed = trainer(ema=0.99)
    resumed.fit(BATCHES, epochs=2, resume=folder / "2")
    assert resumed.progress.step == 4
