"""One training run of a composition row, and what it leaves to check: the
whole state, the parameters and their average, the history and the lines
its logger wrote."""

import dataclasses
import json
import pathlib
from typing import Any

import equinox as eqx
import jax
import numpy as np
import pytest
from typing_extensions import override

import phalanx as px
from combinations import (
    CRASH,
    EPOCHS,
    SAVE_EVERY,
    Combination,
    build,
    data,
)
from helpers import RaiseAt
from phalanx import TrainState


TRAIN, EVAL = data()


@dataclasses.dataclass
class Outcome:
    """What a run left.

    Attributes:
        state: every array of the final `TrainState` (step, parameters,
            optimizer state, key, average, ...) by path, on the host.
        params: the parameters.
        ema: the averaged parameters (None without ``ema``).
        epochs: the history's epochs.
        evaluations: the history's evaluations.
        lines: the JSONLogger's lines, parsed.
        trajectory: the parameters after each step (recorded runs only).
        misplaced: the state leaves not laid out as their parameters.
    """

    state: dict[str, np.ndarray]
    params: list[np.ndarray]
    ema: list[np.ndarray] | None
    epochs: list[dict[str, Any]]
    evaluations: list[dict[str, Any]]
    lines: list[dict[str, Any]]
    trajectory: list[list[np.ndarray]]
    misplaced: list[str]


def floats(tree: Any) -> list[np.ndarray]:
    """The floating-point arrays of a model, on the host."""
    return [
        np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))
    ]


class Record(px.Callback):
    """Keeps the parameters after each step (one step a call: the state is
    that step's)."""

    def __init__(self) -> None:
        self.trajectory: list[list[np.ndarray]] = []

    @override
    def on_step_end(self, info: px.callbacks.StepInfo) -> None:
        self.trajectory.append(floats(info.trainer.model))


def named_arrays(state: TrainState) -> dict[str, np.ndarray]:
    """Every array of `state` by path, on the host (a PRNG key as its data)."""
    return {
        jax.tree_util.keystr(path): np.asarray(
            jax.random.key_data(leaf)
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
            else leaf
        )
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            eqx.filter(state, eqx.is_array)
        )[0]
    }


def misplaced(state: TrainState) -> list[str]:
    """The optimizer state and average leaves not laid out as the parameter
    of their shape (each parameter of `Net` has a shape of its own): a
    group's moments kept whole where their parameter is split, say."""
    params = {
        leaf.shape: (jax.tree_util.keystr(path), leaf.sharding)
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            eqx.filter(state.model, eqx.is_inexact_array)
        )[0]
    }
    found = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(
        (state.opt_state, state.ema)
    )[0]:
        if not isinstance(leaf, jax.Array) or leaf.shape not in params:
            continue
        name, sharding = params[leaf.shape]
        if not leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
            found.append(
                f"{jax.tree_util.keystr(path)} is laid out as {leaf.sharding}, "
                f"the parameter {name} as {sharding}"
            )
    return found


def train(
    combo: Combination,
    folder: pathlib.Path,
    *,
    crash: bool = False,
    resume: bool = False,
    record: bool = False,
) -> Outcome:
    """Run `combo` in `folder`: straight through; or, with `crash`, killed
    at step `CRASH` after saving every `SAVE_EVERY` steps (no save on the
    way out); or, with `resume`, a new trainer resuming from the newest
    save in `folder` (its logger's file the killed run's)."""
    callbacks: list[px.Callback] = []
    if crash:
        callbacks.append(RaiseAt(CRASH))
    recorder = Record()
    if record:
        callbacks.append(recorder)
    callbacks.append(px.callbacks.JSONLogger(folder / "log.jsonl", log_every=1))
    if crash or resume:
        callbacks.append(
            px.callbacks.Checkpoint(
                folder / "checkpoints", every_n_steps=SAVE_EVERY, every_n_epochs=None
            )
        )
    trainer = build(combo, callbacks)
    fit: dict[str, Any] = dict(
        epochs=EPOCHS, eval_data=EVAL, eval_every=combo.eval_every
    )
    if crash:
        with pytest.raises(RuntimeError, match=f"boom at step {CRASH}"):
            trainer.fit(TRAIN, **fit)
    else:
        trainer.fit(TRAIN, **fit, resume="latest" if resume else None)
    lines = (folder / "log.jsonl").read_text().splitlines()
    return Outcome(
        state=named_arrays(trainer.state),
        params=floats(trainer.model),
        ema=floats(trainer.ema_model) if combo.ema else None,
        epochs=[dict(epoch) for epoch in trainer.history.epochs],
        evaluations=trainer.history.evaluations,
        lines=[json.loads(line) for line in lines],
        trajectory=recorder.trajectory,
        misplaced=misplaced(trainer.state),
    )
