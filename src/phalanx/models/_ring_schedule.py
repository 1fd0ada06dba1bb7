"""Which blocks of attention each device computes at each step of a ring.

A sequence split over ``n`` devices is cut into parts; each device holds some
parts of the queries, and the keys and values of the same parts travel round
the ring, one device's parts per step. At step ``t`` device ``d`` holds the
keys of device ``(d - t) mod n``. A block is one query part against one key
part: computed in full, computed with the causal mask (the diagonal, a part
against itself), or skipped (every key after every query).

Two layouts of the parts, for causal attention over ``2n`` half-chunks:
``contiguous`` (device ``d`` holds the halves ``2d`` and ``2d + 1``: the
last device computes ``n`` times the first's work) and ``balanced`` (device
``d`` holds the halves ``d`` and ``2n - 1 - d``, opposite ends of the
sequence: every device computes two full blocks a step). This module is
plain Python on static shapes: the ring (`_ring.py`) executes the schedule it
derives, and the tests count each device's FLOPs from the same schedule.
"""

import dataclasses
from typing import Literal, TypeAlias


Layout: TypeAlias = Literal["contiguous", "balanced"]


@dataclasses.dataclass(frozen=True)
class Block:
    """One query part of a device against one key part it holds at a step.

    Attributes:
        query_part: which of the device's query parts (0 or 1).
        key_part: which of the visiting key/value parts.
        causal: the diagonal block (a part against itself), masked within;
            otherwise every key is visible to every query.
    """

    query_part: int
    key_part: int
    causal: bool


def part_positions(layout: Layout, parts: int, n: int, device: int) -> list[int]:
    """The global indices of `device`'s parts among ``parts * n`` parts."""
    if layout == "balanced":
        assert parts == 2
        return [device, 2 * n - 1 - device]
    return [device * parts + p for p in range(parts)]


def ring_schedule(
    n: int, *, causal: bool, layout: Layout = "balanced"
) -> list[list[list[Block]]]:
    """The blocks computed by each device at each step: ``[device][step]``.

    Non-causal attention has one part per device and computes every block;
    causal attention has two halves per device in `layout`, and skips the
    blocks whose keys all come after its queries.
    """
    parts = 2 if causal else 1
    if not causal:
        layout = "contiguous"  # one chunk per device, every block computed
    schedule = []
    for device in range(n):
        queries = part_positions(layout, parts, n, device)
        steps = []
        for step in range(n):
            source = (device - step) % n
            keys = part_positions(layout, parts, n, source)
            blocks = []
            for qp, q in enumerate(queries):
                for kp, k in enumerate(keys):
                    if not causal or q > k:
                        blocks.append(Block(qp, kp, causal=False))
                    elif q == k:
                        blocks.append(Block(qp, kp, causal=True))
            # Diagonal blocks first, then by part: the same slots on every
            # device when the layout is balanced.
            steps.append(sorted(blocks, key=lambda b: (not b.causal, b.query_part)))
        schedule.append(steps)
    return schedule


def slot_tables(
    schedule: list[list[list[Block]]], steps: range
) -> tuple[tuple[bool, ...], list[list[list[int]]], list[list[list[int]]]]:
    """The schedule of `steps` as one program every device runs.

    Returns ``(causal, query_parts, key_parts)``: the kind of each slot (the
    same on every device and step), and the parts each slot reads, indexed
    ``[step][device][slot]``.

    Raises:
        ValueError: the devices or steps do not compute blocks of the same
            kinds (the layout is unbalanced): one program cannot run it.
    """
    kinds = {
        tuple(b.causal for b in schedule[d][t])
        for d in range(len(schedule))
        for t in steps
    }
    if len(kinds) != 1:
        raise ValueError(
            f"the ring's steps {list(steps)} compute blocks of different kinds "
            f"on different devices ({sorted(kinds)}): the layout is unbalanced"
        )
    query_parts = [[[b.query_part for b in s[t]] for s in schedule] for t in steps]
    key_parts = [[[b.key_part for b in s[t]] for s in schedule] for t in steps]
    return kinds.pop(), query_parts, key_parts
