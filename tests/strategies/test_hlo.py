"""Invariant 2: one cross-device gradient reduction per optimizer update.

Counts all-reduce instructions in the compiled HLO of the train step, and
checks that none sits inside a loop body (accumulation written in the global
view, under `jax.jit`'s automatic sharding, all-reduces once per microbatch).
Every strategy of the registry is checked (`helpers.kinds`: each alone and
over 2 and 4 microbatches, `MeshStrategy` and `AccumulatingStrategy(MeshStrategy)`
included), compile-only, and a reduction planted in the microbatch loop is
seen."""

import functools
import re

import jax
import optax
import pytest

import phalanx as px
from helpers import KINDS, kinds, make_data, make_model, make_strategy


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


def reductions(hlo: str) -> list[str]:
    """The cross-device reductions among `hlo`'s instructions: all-reduces
    and reduce-scatters (a split gradient's)."""
    pattern = r"\b(all-reduce|reduce-scatter)(-start)?\("
    return [line for line in hlo.splitlines() if re.search(pattern, line)]


def reductions_per_update(hlo: str) -> int:
    """How many cross-device reductions one call of the compiled step runs:
    each computation's own, plus its callees' (a while loop's body times its
    known trip count, both branches of a conditional: an upper bound)."""
    named = computations(hlo)

    @functools.cache
    def count(name: str) -> int:
        body = named.get(name, "")
        total = 0
        for line in body.splitlines()[1:]:  # the first is the header
            if re.search(r"\b(all-reduce|reduce-scatter)(-start)?\(", line):
                total += 1
            loop = re.search(r"\bbody=%([\w.\-]+)", line)
            if loop:
                trips = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
                total += (int(trips.group(1)) if trips else 1) * count(loop.group(1))
                continue
            for callees in re.findall(
                r"(?:to_apply|calls|branch_computations)=\{?([%\w.\-, ]+)\}?", line
            ):
                for callee in re.findall(r"%([\w.\-]+)", callees):
                    total += count(callee)
        return total

    (entry,) = re.findall(r"^ENTRY %([\w.\-]+) ", hlo, flags=re.MULTILINE)
    return count(entry)


def reductions_in_loops(hlo: str) -> list[str]:
    """The reductions inside a while loop's body (or what it calls)."""
    looped = in_loops(hlo)
    return [
        line
        for name, body in computations(hlo).items()
        if name in looped
        for line in reductions(body)
    ]


def compiled(strategy: px.Strategy) -> str:
    """The compiled HLO of a train step of the test model under `strategy`."""
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), strategy=strategy)
    text = trainer.lower(make_data(64)).compile().as_text()
    assert text is not None
    return text


@functools.cache
def compiled_kind(kind: str) -> str:
    return compiled(make_strategy(kind, 8))


@pytest.mark.parametrize("kind", kinds())
def test_every_registered_strategy_reduces_once_per_update(kind):
    # The registry's strategies on 8 devices, alone and accumulating: no
    # reduction inside a loop (the microbatch scan), and as many per update
    # over 4 microbatches as over 2 (an unrolled per-microbatch reduction
    # would add them up).
    hlo = compiled_kind(kind)
    assert reductions(hlo), "the step reduces across devices"
    assert not reductions_in_loops(hlo), reductions_in_loops(hlo)
    base, _, acc = kind.partition("+")
    if acc:
        assert in_loops(hlo), "accumulation should scan over microbatches"
        assert reductions_per_update(hlo) == reductions_per_update(
            compiled_kind(f"{base}+acc2")
        )


@pytest.mark.parametrize("kind", ["mesh", "pmap"])
def test_a_reduction_per_microbatch_is_seen(kind, monkeypatch):
    # Plant the trap: each microbatch's sums reduced across devices inside
    # the scan. The checks above must fail on it.
    before = reductions_per_update(compiled_kind(f"{kind}+acc2"))
    accumulate = px.AccumulatingStrategy._accumulate

    def per_microbatch(self, fn):
        def reduced(replicated, carry, examples):
            sums, carry = fn(replicated, carry, examples)
            return jax.lax.psum(sums, self.inner.axis_name), carry

        return accumulate(self, reduced)

    monkeypatch.setattr(px.AccumulatingStrategy, "_accumulate", per_microbatch)
    two = compiled(make_strategy(f"{kind}+acc2", 8))
    four = compiled(make_strategy(f"{kind}+acc4", 8))
    assert reductions_in_loops(two) and reductions_in_loops(four)
    assert before < reductions_per_update(two) < reductions_per_update(four)


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
