"""Grain as `fit`'s data (issue 45, item 1): `px.data.GrainLoader`'s
batches (each process's slice of the same global batches on any process
count, every example once an epoch, padding, its state) and grain's own
datasets and loaders given to `fit` directly, resumed bitwise from a
checkpoint without re-reading."""

import equinox as eqx
import grain
import jax
import numpy as np
import optax
import pytest

import phalanx as px
from phalanx.data._grain_iterables import GrainIterable


class Source:
    """Example ``i``: features starting with ``i``, label ``i % 3``."""

    def __init__(self, n: int = 50):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        rng = np.random.default_rng(index)
        features = rng.standard_normal(4).astype(np.float32)
        features[0] = index
        return features, np.int32(index % 3)

    def __repr__(self) -> str:  # grain's DataLoader checks it on restore
        return f"Source({self.n})"


def _global(batches_per_process: list[list[tuple]]) -> list[np.ndarray]:
    """The global batches' example ids: the processes' slices in order."""
    return [
        np.concatenate([per[j][0][:, 0] for per in batches_per_process])
        for j in range(len(batches_per_process[0]))
    ]


def _loader(processes: int = 1, index: int = 0, **options) -> px.data.GrainLoader:
    options = {"seed": 1, **options}
    return px.data.GrainLoader(
        Source(), 12, process_count=processes, process_index=index, **options
    )


@pytest.mark.parametrize("processes", [2, 4])
def test_every_process_count_reads_the_same_global_batches(processes):
    one = _global([list(_loader())])
    many = _global([list(_loader(processes, p)) for p in range(processes)])
    assert len(one) == len(many) == 5
    for a, b in zip(one, many, strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_epoch_is_every_example_once_then_a_new_order():
    loader = _loader()
    first = list(loader)
    ids, weights = (
        np.concatenate([b[0][:, 0] for b in first]),
        np.concatenate([b[2] for b in first]),
    )
    assert sorted(ids[weights == 1].astype(int)) == list(range(50))
    # The short last batch is padded with zeros of weight 0.
    np.testing.assert_array_equal(first[-1][2], [1, 1] + [0] * 10)
    assert not first[-1][0][2:].any()
    assert loader.state_dict() == {"epoch": 1, "position": 0, "batch_size": 12}
    second = np.concatenate([b[0][:, 0] for b in loader])
    assert not np.array_equal(ids, second)
    dropped = px.data.GrainLoader(
        Source(), 12, drop_last=True, process_count=1, process_index=0
    )
    assert len(dropped) == len(list(dropped)) == 4


def test_state_resumes_at_the_next_batch_and_augment_draws_alike():
    def augment(example, rng):
        return example[0] + rng.normal(size=4).astype(np.float32), example[1]

    def make():
        return px.data.GrainLoader(
            Source(), 8, seed=2, augment=augment, process_count=1, process_index=0
        )

    straight = [b[0] for b in make()]
    loader = make()
    loader.load_state_dict({"epoch": 0, "position": 3})
    for a, b in zip(straight[3:], loader, strict=True):
        np.testing.assert_array_equal(a, b[0])


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="IterDataset.*random access"):
        px.data.GrainLoader(grain.MapDataset.source(Source()).to_iter_dataset(), 8)
    with pytest.raises(TypeError, match="source is a int"):
        px.data.GrainLoader(3, 8)
    with pytest.raises(
        ValueError, match="batch_size=10 is not divisible by process_count=4"
    ):
        px.data.GrainLoader(Source(), 10, process_count=4, process_index=0)
    loader = px.data.GrainLoader(Source(), 8, process_count=1, process_index=0)
    with pytest.raises(ValueError, match="past the 7 batches"):
        loader.load_state_dict({"epoch": 0, "position": 7})
    with pytest.raises(ValueError, match="exactly the keys"):
        loader.load_state_dict({"epoch": 0})


def _trainer(folder=None, devices: int = 8) -> px.DataParallelTrainer:
    model = px.models.MLP(4, 3, hidden=(8,), key=jax.random.key(0))
    callbacks = []
    if folder is not None:
        callbacks = [px.callbacks.Checkpoint(folder, every_n_steps=1)]
    return px.DataParallelTrainer(
        model,
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(jax.devices()[:devices]),
        callbacks=callbacks,
        progress=False,
    )


def _data(kind: str):
    if kind == "GrainLoader":
        return px.data.GrainLoader(Source(40), 8, seed=0)
    if kind == "DataLoader":
        sampler = grain.samplers.IndexSampler(40, shuffle=True, seed=0, num_epochs=1)
        return grain.DataLoader(
            data_source=Source(40),
            sampler=sampler,
            operations=[grain.transforms.Batch(8)],
        )
    batches = grain.MapDataset.source(Source(40)).shuffle(seed=0).batch(8)
    return batches.to_iter_dataset() if kind == "IterDataset" else batches


@pytest.mark.parametrize(
    "kind", ["GrainLoader", "MapDataset", "IterDataset", "DataLoader"]
)
def test_fit_resumes_grain_data_mid_epoch_bitwise(kind, tmp_path):
    straight = _trainer()
    straight.fit(_data(kind), epochs=2)
    _trainer(tmp_path).fit(_data(kind), steps=7)  # stops in epoch 1, at batch 2 of 5
    resumed = _trainer(tmp_path)
    resumed.fit(_data(kind), epochs=2, resume="latest")
    assert int(resumed.state.step) == 10
    for a, b in zip(
        jax.tree.leaves(eqx.filter(straight.state, eqx.is_inexact_array)),
        jax.tree.leaves(eqx.filter(resumed.state, eqx.is_inexact_array)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_grain_iterator_state_does_not_carry_to_another_process_count():
    wrapped = GrainIterable(_data("IterDataset"))
    next(iter(wrapped))
    state = wrapped.state_dict()
    assert state["processes"] == 1 and state["iterator"] is not None
    with pytest.raises(ValueError, match="run on 2 process.*GrainLoader"):
        wrapped.load_state_dict({**state, "processes": 2})


def test_a_grain_run_resumes_on_another_device_count(tmp_path):
    """Stopped on 8 devices mid-epoch, resumed on 4: the same batches
    (GrainLoader's state is in global batches), the same update to
    summation order."""
    straight = _trainer()
    straight.fit(_data("GrainLoader"), epochs=2)
    _trainer(tmp_path).fit(_data("GrainLoader"), steps=7)
    resumed = _trainer(tmp_path, devices=4)
    resumed.fit(_data("GrainLoader"), epochs=2, resume="latest")
    for a, b in zip(
        jax.tree.leaves(eqx.filter(straight.state, eqx.is_inexact_array)),
        jax.tree.leaves(eqx.filter(resumed.state, eqx.is_inexact_array)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
