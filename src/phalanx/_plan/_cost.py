"""A compiled step's work on one device, read loop by loop from its
optimized HLO (`jax.stages.Compiled.as_text`): its matrix FLOPs, the bytes
its kernels read and write, and how many collectives it runs.

Why not XLA's own `Compiled.cost_analysis()` alone: it counts a while
loop's body once, known trip count or not (measured, JAX 0.10.2, XLA:CPU: a
`lax.scan` of 10 matrix multiplies reports one), and a step's microbatches
and `Stacked` layers are loops. So this module counts what XLA's analysis
counts, per instruction, and multiplies each loop's body by its trip count.
(Nor its "bytes accessed" as a floor: on a TPU it counts the buffers XLA
keeps in on-chip memory, and each asynchronous slice's whole source.)

What it counts, per device (the module is the partitioned program):

- FLOPs: ``2·m·n·k`` per ``dot`` (its output's elements times its
  contracting sizes), ``2`` per multiply-add of a ``convolution`` that meets
  an input element, inside fusions too (`_hlo_flops`); elementwise work is
  left out (it is costed as memory traffic, and the FLOP/s it is divided
  by are the matrix units').
- Bytes, in the device's memory (XLA:TPU's on-chip buffers, ``S(1)`` in
  their layouts, cost none): each kernel (a fusion, or an unfused
  instruction) reads its operands and writes its result once; where a
  fusion only slices an operand (``dynamic-slice``, ``slice``,
  ``gather``), the slice is read, and where it updates one in place
  (``dynamic-update-slice``), the update is written and the rest untouched:
  a scan reading one layer of a stack of them reads one layer, not the
  stack, each trip. An asynchronous slice or copy (``slice-start``,
  ``copy-start``) reads and writes its result once.
- Seconds, at the rates given: each kernel's FLOPs or its bytes, whichever
  takes longer, summed (on a v5e, the tests' transformer and the wide MLP,
  fp32 and bf16: within 7% of the step's measured time each).
- Collectives: each all-reduce, all-gather, reduce-scatter, all-to-all
  and collective-permute over more than one device, each trip of a loop.

A while loop's body is counted its trip count times (`_hlo.loop_trips`:
XLA's ``known_trip_count``, or its condition's bound; once where neither
says), a ``conditional``'s dearest branch.
"""

import re
from typing import NamedTuple

from ._hlo import (
    _OP,
    _bytes,
    _computations,
    _entry,
    _group_size,
    hbm_bytes,
    loop_trips,
)
from ._hlo_flops import instruction_flops


class StepWork(NamedTuple):
    """What one run of a compiled program does on one device.

    Attributes:
        flops: its matrix multiplies' and convolutions' FLOPs.
        bytes: the bytes its kernels read and write.
        collectives: the collectives it runs (loops' trips included).
        seconds: its kernels' time at the rates `step_work` was given, each
            kernel at the pace of the slower of its FLOPs and its memory
            traffic (a kernel's overlap; kernels run one after another).
    """

    flops: float
    bytes: float
    collectives: int
    seconds: float = 0.0


_ZERO = StepWork(0.0, 0.0, 0)
_COMMENT = re.compile(r"/\*.*?\*/")
_INSTRUCTION = re.compile(
    r"^(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$"
)
_CALLS = re.compile(r"\b(?:calls|to_apply)=%?([\w.\-]+)")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_BRANCHES = re.compile(
    r"\b(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+))"
)
# Instructions that move no data of their own (a while, call or
# conditional is its computations' work; an async pair's is its start's).
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast",
    "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
    "domain", "all-reduce-done", "all-gather-done", "collective-permute-done",
    "copy-done", "slice-done", "async-done", "async-update", "send-done",
    "recv-done",
}  # fmt: skip
_SLICES = {"dynamic-slice", "slice", "gather"}


class _Instruction(NamedTuple):
    name: str
    type: str
    op: str
    operands: list[str]
    attributes: str
    line: str


def step_work(
    hlo: str, devices: int, rates: tuple[float, float] = (1.0, 1.0)
) -> StepWork:
    """The work of one run of the program `hlo` (the text of a compiled,
    partitioned module) on one of its `devices` devices (see module), its
    kernels timed at `rates` (FLOP/s, bytes/s)."""
    flop_rate, byte_rate = rates

    def kernel(flops: float, moved: float, sends: bool) -> StepWork:
        seconds = max(flops / flop_rate, moved / byte_rate)
        return StepWork(flops, moved, int(sends), seconds)

    texts = _computations(hlo)
    bodies = {name: [_parse(line) for line in lines] for name, lines in texts.items()}
    parsed = {
        name: [i for i in found if i is not None] for name, found in bodies.items()
    }
    types = {name: {i.name: i.type for i in found} for name, found in parsed.items()}
    memo: dict[str, StepWork] = {}
    fused: dict[str, float] = {}

    def flops_in(name: str) -> float:
        """The FLOPs of a fused computation (and those it calls)."""
        if name not in fused:
            fused[name] = 0.0  # a computation never calls itself; guards a cycle
            fused[name] = sum(
                _flops(i, types[name])
                + sum(flops_in(c) for c in _CALLS.findall(i.attributes))
                for i in parsed.get(name, [])
            )
        return fused[name]

    def run(name: str) -> StepWork:
        """The work of running computation `name` once."""
        if name not in memo:
            memo[name] = _ZERO
            total = _ZERO
            for i in parsed.get(name, []):
                total = _add(total, one(i, types[name]))
            memo[name] = total
        return memo[name]

    def one(i: _Instruction, known: dict[str, str]) -> StepWork:
        if i.op == "while":
            times = loop_trips(i.line, texts)
            body = _BODY.search(i.attributes)
            condition = _CONDITION.search(i.attributes)
            work = _add(
                run(body.group(1)) if body else _ZERO,
                run(condition.group(1)) if condition else _ZERO,
            )
            return StepWork(
                times * work.flops,
                times * work.bytes,
                times * work.collectives,
                times * work.seconds,
            )
        if i.op == "conditional":
            names = [
                n.strip().lstrip("%")
                for listed, single in _BRANCHES.findall(i.attributes)
                for n in (listed.split(",") if listed else [single])
                if n.strip()
            ]
            return max(
                (run(n) for n in names), key=lambda w: (w.flops, w.bytes), default=_ZERO
            )
        if i.op in ("call", "async-start"):
            work = _ZERO
            for called in _CALLS.findall(i.attributes):
                work = _add(work, run(called))
            return work
        if i.op in _FREE:
            return _ZERO
        op = _OP.search(i.line)
        sends = op is not None and _group_size(i.line, devices) > 1
        if i.op == "fusion":
            called = _CALLS.search(i.attributes)
            flops = flops_in(called.group(1)) if called else 0.0
            moved = _fusion_bytes(
                i, known, parsed.get(called.group(1), []) if called else []
            )
            return kernel(flops, moved, sends)
        return kernel(_flops(i, known), _unfused_bytes(i, known), sends)

    entry = _entry(hlo)
    return run(entry) if entry else _ZERO


def _parse(line: str) -> _Instruction | None:
    """One instruction of a computation's body (None: not one)."""
    if "/*" in line:
        line = _COMMENT.sub("", line)
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    rest = match.group("rest")
    end = rest.find(")")
    if end < 0 or "(" in rest[:end]:  # an operand with parentheses: walk them
        end = _closing(rest)
    operands = [token.split()[-1].lstrip("%") for token in _split(rest[:end])]
    return _Instruction(
        match.group("name"), match.group("type"), match.group("op"), operands,
        rest[end + 1 :], line,
    )  # fmt: skip


def _closing(text: str) -> int:
    """Where the parenthesis opened before `text` closes."""
    depth = 1
    for at, char in enumerate(text):
        depth += char in "([{"
        depth -= char in ")]}"
        if depth == 0:
            return at
    return len(text)


def _split(operands: str) -> list[str]:
    """The comma-separated operands of a call, commas inside brackets kept."""
    if not any(bracket in operands for bracket in "([{"):
        return [token for token in operands.split(",") if token.strip()]
    tokens, depth, current = [], 0, ""
    for char in operands:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            tokens.append(current)
            current = ""
        else:
            current += char
    tokens.append(current)
    return [token for token in tokens if token.strip()]


def _flops(i: _Instruction, known: dict[str, str]) -> float:
    operands = [known.get(o, "") for o in i.operands]
    return instruction_flops(i.op, i.type, operands, i.attributes)


def _unfused_bytes(i: _Instruction, known: dict[str, str]) -> float:
    """The bytes an instruction outside any fusion reads and writes in the
    device's memory (XLA:TPU's on-chip buffers, ``S(1)``, left out)."""
    if i.op in ("dynamic-slice", "slice"):
        return 2.0 * hbm_bytes(i.type)
    if i.op == "dynamic-update-slice" and len(i.operands) > 1:
        return 2.0 * hbm_bytes(known.get(i.operands[1], ""))
    if i.op in ("slice-start", "copy-start") and i.operands:
        # An asynchronous slice or copy (XLA:TPU prefetching into on-chip
        # memory): typed (source, result, context); it reads what it
        # writes, from the source's memory, into the result's.
        parts = _split(i.type.strip()[1:-1])
        if len(parts) > 1:
            read = _bytes(parts[1]) if hbm_bytes(known.get(i.operands[0], "")) else 0
            return float(read + hbm_bytes(parts[1]))
    return float(
        hbm_bytes(i.type) + sum(hbm_bytes(known.get(o, "")) for o in i.operands)
    )


def _fusion_bytes(
    i: _Instruction, known: dict[str, str], body: list[_Instruction]
) -> float:
    """The bytes a fusion reads and writes: each operand whole, or the
    slices its body takes of it; its result whole, or the update its body
    writes in place."""
    inner = {b.name: b for b in body}
    params = {
        int(p.operands[0]): p.name
        for p in body
        if p.op == "parameter" and p.operands and p.operands[0].isdigit()
    }
    users: dict[str, list[_Instruction]] = {}
    for b in body:
        for operand in b.operands:
            users.setdefault(operand, []).append(b)

    def read(name: str, whole: float) -> float:
        using = users.get(name, [])
        if using and all(u.op == "bitcast" for u in using):
            return sum(read(u.name, whole) for u in using)
        if using and all(u.op in _SLICES and u.operands[0] == name for u in using):
            return float(sum(hbm_bytes(u.type) for u in using))
        if using and all(
            u.op == "dynamic-update-slice" and u.operands[0] == name for u in using
        ):
            return 0.0  # updated in place: only the update is written
        return whole

    moved = 0.0
    for index, operand in enumerate(i.operands):
        whole = float(hbm_bytes(known.get(operand, "")))
        moved += read(params[index], whole) if index in params else whole
    root = next((b for b in body if b.line.lstrip().startswith("ROOT")), None)
    results = [root] if root is not None and root.op != "tuple" else []
    if root is not None and root.op == "tuple":
        results = [inner[o] for o in root.operands if o in inner]
    if not results:
        return moved + hbm_bytes(i.type)
    for result in results:
        update = result.op == "dynamic-update-slice" and len(result.operands) > 1
        moved += hbm_bytes(
            inner[result.operands[1]].type
            if update and result.operands[1] in inner
            else result.type
        )
    return moved


def _add(a: StepWork, b: StepWork) -> StepWork:
    return StepWork(
        a.flops + b.flops,
        a.bytes + b.bytes,
        a.collectives + b.collectives,
        a.seconds + b.seconds,
    )
