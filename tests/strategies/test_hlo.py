"""Invariant 2: one cross-device gradient reduction per optimizer update.

Counts all-reduce instructions in the compiled HLO of the train step, and
checks that none sits inside a loop body (accumulation written in the global
view, under `jax.jit`'s automatic sharding, all-reduces once per microbatch)."""

import re

import optax
import pytest

import phalanx as px
from helpers import KINDS, make_data, make_model, make_strategy


def computations(hlo: str) -> dict[str, str]:
    """Computation name -> body text of an HLO module."""
    blocks = re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ )", hlo)
    named = {}
    for block in blocks:
        match = re.match(r"(?:ENTRY )?%([\w.\-]+) ", block)
        if match:
            named[match.group(1)] = block
    return named


def in_loops(hlo: str) -> set[str]:
    """Names of computations run by a while loop, directly or indirectly."""
    named = computations(hlo)
    todo = re.findall(r"\bbody=%([\w.\-]+)", hlo) + re.findall(
        r"\bcondition=%([\w.\-]+)", hlo
    )
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in named:
            continue
        seen.add(name)
        todo += re.findall(
            r"(?:to_apply|calls|body|condition|branch_computations)=\{?%([\w.\-]+)",
            named[name],
        )
    return seen


def all_reduces(hlo: str) -> list[str]:
    return [
        line for line in hlo.splitlines() if re.search(r"\ball-reduce(-start)?\(", line)
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_one_all_reduce_per_update(kind):
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=make_strategy(kind, 8)
    )
    hlo = trainer.lower(make_data(64)).compile().as_text()
    assert hlo is not None
    assert len(all_reduces(hlo)) == 1, all_reduces(hlo)
    looped = in_loops(hlo)
    for name, body in computations(hlo).items():
        if name in looped:
            assert not all_reduces(body), f"all-reduce inside loop body {name}"
    if "acc" in kind:
        assert looped, "accumulation should scan over microbatches"


@pytest.mark.parametrize(
    "strategy",
    [
        lambda: px.ShardingStrategy(8, deterministic=True),
        lambda: px.PmapStrategy(8, deterministic=True),
        lambda: px.AccumulatingStrategy(px.PmapStrategy(8, deterministic=True), 4),
    ],
)
def test_deterministic_reduction_gathers_once_per_update(strategy):
    # All-gathers (one per reduced array) instead of the all-reduce, and none
    # inside the accumulation loop.
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=strategy()
    )
    hlo = trainer.lower(make_data(64)).compile().as_text()
    assert hlo is not None
    gathers = [
        line for line in hlo.splitlines() if re.search(r"\ball-gather(-start)?\(", line)
    ]
    assert gathers and not all_reduces(hlo)
    looped = in_loops(hlo)
    for name, body in computations(hlo).items():
        if name in looped:
            assert "all-gather" not in body, f"all-gather inside loop body {name}"


def test_loop_detection_sees_an_all_reduce_in_a_scan():
    # The checker itself must catch the trap: a global-view scan whose body
    # reduces across devices.
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = px.ShardingStrategy(8).mesh
    x = jax.device_put(jnp.ones((4, 64)), NamedSharding(mesh, P(None, "data")))

    def f(x):
        return jax.lax.scan(lambda c, row: (c + jnp.sum(row), None), 0.0, x)[0]

    hlo = jax.jit(f).lower(x).compile().as_text()
    assert hlo is not None
    looped = in_loops(hlo)
    assert any(
        all_reduces(body) for n, body in computations(hlo).items() if n in looped
    )
