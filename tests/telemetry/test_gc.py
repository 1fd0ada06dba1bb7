"""Issue 33, part 4: the trainer's ``gc=``: what the collector does during
`fit`, and the user's settings back afterwards, also after an exception."""

import gc

import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import make_model
from test_timeline import batches


class Watch(px.Callback):
    """Notes the collector's state after each step; raises at `fail`."""

    def __init__(self, fail: int | None = None):
        self.fail = fail
        self.seen: list[tuple[bool, int]] = []

    @override
    def on_step_end(self, info):
        self.seen.append((gc.isenabled(), gc.get_freeze_count()))
        if info.step == self.fail:
            raise RuntimeError("planted")


def fit(mode: str, watch: Watch, steps: int = 6) -> px.DataParallelTrainer:
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(1),
        callbacks=[watch],
        gc=mode,  # pyright: ignore[reportArgumentType]
        sync_every=2,
        progress=False,
    )
    trainer.fit(batches(steps), epochs=1)
    return trainer


@pytest.fixture
def user_settings():
    """A user's own settings: the collector off, other thresholds."""
    before = gc.isenabled(), gc.get_threshold()
    gc.disable()
    gc.set_threshold(1234, 5, 6)
    yield (False, (1234, 5, 6))
    gc.set_threshold(*before[1])
    if before[0]:
        gc.enable()


@pytest.mark.parametrize("mode", ["auto", "off", "python"])
def test_settings_restored_after_fit(mode, user_settings):
    watch = Watch()
    fit(mode, watch)
    assert (gc.isenabled(), gc.get_threshold()) == user_settings
    assert gc.get_freeze_count() == 0
    if mode == "auto":  # frozen after the first sync point, collector off
        assert watch.seen[0] == (False, 0)
        assert watch.seen[-1][0] is False and watch.seen[-1][1] > 0
    elif mode == "off":
        assert all(seen == (False, 0) for seen in watch.seen)


def test_settings_restored_after_an_exception():
    assert gc.isenabled()
    threshold = gc.get_threshold()
    watch = Watch(fail=4)
    with pytest.raises(RuntimeError, match="planted"):
        fit("auto", watch)
    assert watch.seen[-1][0] is False  # it was off in the loop
    assert gc.isenabled() and gc.get_threshold() == threshold
    assert gc.get_freeze_count() == 0


def test_python_leaves_the_collector_alone():
    watch = Watch()
    fit("python", watch)
    assert all(seen == (True, 0) for seen in watch.seen)


def test_a_bad_mode_is_named():
    with pytest.raises(ValueError, match="gc='sometimes' must be 'auto', 'off' or"):
        px.DataParallelTrainer(make_model(), optax.adam(1e-2), gc="sometimes")  # pyright: ignore[reportArgumentType]
