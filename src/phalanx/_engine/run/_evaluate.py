"""Evaluation: every example of a set through the compiled eval step, its
weighted sums added up on the devices and divided once on the host.

Used by ``trainer.evaluate`` and by the evaluations inside ``fit``; it reads
the state's arrays it is given and changes nothing.
"""

from collections.abc import Iterable
from typing import Any

import jax

from ..._checks._run_errors import empty_data_message
from ..._telemetry._watchdog import beat
from ..._typing import EvalSets, HostMetrics
from ..feed._feed import Feed
from ..feed._pipeline import BatchPipeline
from ..feed._prepare import first_program
from ..program._programs import Programs


def evaluate_sets(
    pipeline: BatchPipeline,
    programs: Programs,
    leaves: list[jax.Array],
    sets: EvalSets,
    *,
    depth: int,
    sync_every: int,
) -> HostMetrics:
    """Every set's results, prefixed as its metrics are named in `fit`
    (``eval_loss``, ``eval_<name>_loss``, ...)."""
    results: HostMetrics = {}
    for prefix, data in sets:
        where = "eval_data" if prefix == "eval_" else f"eval_data[{prefix[5:-1]!r}]"
        metrics = evaluate(
            pipeline, programs, leaves, data, where, depth=depth, sync_every=sync_every
        )
        results.update({prefix + name: value for name, value in metrics.items()})
    return results


def evaluate(
    pipeline: BatchPipeline,
    programs: Programs,
    leaves: list[jax.Array],
    data: Iterable[Any],
    name: str,
    *,
    depth: int,
    sync_every: int,
) -> HostMetrics:
    """Loss and metrics over every example of `data` (called `name` in
    errors), from the state's arrays `leaves`: batches prepared `depth`
    ahead, the host waiting for the device every `sync_every` batches. A
    trainer with no program yet builds one for the first batch."""
    sums: Any = None

    def where(i: int) -> str:
        return f"batch {i}" if name == "data" else f"{name} batch {i}"

    feed = Feed(pipeline, data, depth=depth, where=where)
    program = programs.first
    if program is None and feed.head is not None:
        program = first_program(pipeline, programs, feed.head, where(0), compile=False)
    with feed as batches:
        for i, placed in enumerate(batches):
            assert program is not None
            if sums is None:
                sums = programs.eval_sums(program)
            sums = program.evaluate(leaves, sums, placed.leaves, placed.weight)
            beat()  # progress, for the hang watchdog
            if (i + 1) % sync_every == 0:
                jax.block_until_ready(sums)
    if sums is None or program is None:
        raise ValueError(empty_data_message(name))
    layout = program.eval_sums
    host = jax.device_get(sums)
    if host[layout.names.index("weight")] == 0:
        raise ValueError(
            f"{name}: every example has sample_weight 0 (total weight 0: "
            "all weights 0, or only padding), so there is nothing to "
            "average; give some examples a weight > 0"
        )
    return layout.means(host)
