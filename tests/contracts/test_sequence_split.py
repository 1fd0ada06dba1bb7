"""`phalanx._contracts.sequence_split`: what a model's own module (not
`px.models.dot_product_attention`) learns of a sequence split over devices:
nothing outside a split step, the split while one is traced (and only there),
and whether it asked. Attention's use of it: tests/models/test_attention.py."""

import dataclasses
import logging
import threading

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import phalanx as px
from phalanx._contracts import SequenceSplit, sequence_split, splitting_sequences
from phalanx.strategies import _mesh_leaves


def split_over(context: int, data: int = 1) -> SequenceSplit:
    devices = np.array(jax.devices()[: data * context]).reshape(data, context)
    mesh = Mesh(devices, ("data", "context"))
    return SequenceSplit(mesh, "context", ("data",) if data > 1 else ())


# --- the context ----------------------------------------------------------------------


def test_a_split_is_seen_only_inside_splitting_sequences():
    split = split_over(4, data=2)
    assert split.size == 4
    assert sequence_split() is None
    with splitting_sequences(split) as asked:
        # phalanx's own look is not the model's asking.
        assert sequence_split(record=False) is split
        assert asked == [False]
        assert sequence_split() is split
        assert asked == [True]
    assert sequence_split() is None
    assert asked == [True]  # read once the trace is done


def test_the_split_is_restored_after_an_exception_and_nested_ones():
    outer, inner = split_over(2), split_over(4)
    with splitting_sequences(outer) as outer_asked:
        with pytest.raises(RuntimeError, match="in the trace"):
            with splitting_sequences(inner):
                assert sequence_split() is inner
                raise RuntimeError("in the trace")
        assert sequence_split(record=False) is outer
        # None inside a split: whole sequences there, and no asking counted.
        with splitting_sequences(None) as whole_asked:
            assert sequence_split() is None
        assert whole_asked == [False] and outer_asked == [False]
        assert sequence_split(record=False) is outer
    assert sequence_split() is None


def test_another_thread_does_not_see_this_threads_split():
    seen = []
    with splitting_sequences(split_over(4)) as asked:
        thread = threading.Thread(target=lambda: seen.append(sequence_split()))
        thread.start()
        thread.join()
        assert asked == [False]
    assert seen == [None]


def test_a_split_cannot_change_while_it_is_traced():
    split = split_over(4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        split.axis = "data"  # pyright: ignore[reportAttributeAccessIssue]


# --- in a step ------------------------------------------------------------------------


VOCAB, WIDTH, SEQ = 8, 8, 8
SEEN: list[SequenceSplit | None] = []


class Asks(eqx.Module):
    """Per-position logits from tokens (no attention); it records the split
    each trace sees, as a user's own attention would ask for it."""

    embed: eqx.nn.Embedding
    out: eqx.nn.Linear

    def __call__(self, tokens: jax.Array) -> jax.Array:
        SEEN.append(sequence_split())
        return jax.vmap(self.out)(jax.vmap(self.embed)(tokens))


def lowered(strategy: px.Strategy) -> list[SequenceSplit | None]:
    """The splits the model saw while its train step was traced for `strategy`."""
    one, two = jax.random.split(jax.random.key(0))
    model = Asks(
        eqx.nn.Embedding(VOCAB, WIDTH, key=one), eqx.nn.Linear(WIDTH, VOCAB, key=two)
    )
    trainer = px.DataParallelTrainer(
        model,
        optax.sgd(0.1),
        loss=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
            logits, y
        ).mean(axis=-1),
        strategy=strategy,
        progress=False,
    )
    tokens = np.random.default_rng(0).integers(0, VOCAB, (16, SEQ)).astype(np.int32)
    SEEN.clear()
    trainer.lower((tokens, tokens))
    return list(SEEN)


def context(data: int) -> px.MeshStrategy:
    return px.MeshStrategy(data=data, context=4, sequence_dims={"x": 1, "y": 1})


def test_a_users_module_is_told_the_split_of_the_step(caplog, monkeypatch):
    monkeypatch.setattr(_mesh_leaves, "_WARNED", set())  # said once a process
    caplog.set_level(logging.WARNING)
    strategy = context(data=2)
    splits = {split for split in lowered(strategy) if split is not None}
    # The global view: the examples split over the batch axes around it.
    assert splits == {SequenceSplit(strategy.mesh, "context", ("data", "fsdp"))}
    # The accumulated step is a per-device program: its examples are already
    # the device's (a probe of the outputs still runs in the global view).
    inner = context(data=2)
    splits = {s for s in lowered(px.AccumulatingStrategy(inner, 2)) if s is not None}
    assert SequenceSplit(inner.mesh, "context", ()) in splits
    assert {(s.mesh, s.axis, s.size) for s in splits} == {(inner.mesh, "context", 4)}
    # It asked: no warning that attention splits nothing.
    assert not [r for r in caplog.records if "asked for the" in r.getMessage()]
    assert sequence_split() is None  # and nothing left behind


def test_a_step_that_splits_no_sequence_says_none():
    seen = lowered(px.MeshStrategy(data=2, fsdp=4))
    assert seen and set(seen) == {None}
