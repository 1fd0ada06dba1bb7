"""The bytes a compiled step sends between devices, read from its
optimized HLO (`jax.stages.Compiled.as_text`): each collective's payload,
costed as a ring moves it, times the trip count of every loop around it
(XLA's own cost analysis counts a loop's body once).

Per device, for a collective over a group of `n` devices whose result is
`b` bytes: an all-reduce sends ``2 b (n-1)/n``, an all-gather and an
all-to-all ``b (n-1)/n``, a reduce-scatter ``b (n-1)`` (its result is the
shard), a collective-permute ``b``.
"""

import math
import re
from collections.abc import Callable


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(
    r"=\s*(?P<type>.+?)\s+(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all"
    r"|collective-permute)(?:-start)?\("
)
_ARRAY = re.compile(
    r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8\w*|bf16|f16|f32|f64|c64|c128)\[([0-9,]*)\]"
)
# An array's layout, where the text gives one: ``{1,0:T(8,128)S(1)}``, its
# memory space after ``S`` (0, the device's memory, where it says none).
_LAYOUT = re.compile(r"\{[^{}]*\}")
_SPACE = re.compile(r"S\((\d+)\)")
_BITS = {"pred": 8, "c64": 64, "c128": 128, "bf16": 16}
_CALLED = re.compile(
    r"\b(?:body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
# XLA's named form: replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_AXIS = re.compile(r"'([^']+)'=(\d+)")


def collective_bytes(hlo: str, devices: int) -> float:
    """The bytes one device sends in one run of the program `hlo` (the
    text of a compiled, partitioned module) on `devices` devices."""
    bodies = _computations(hlo)
    entry = _entry(hlo)
    memo: dict[str, float] = {}

    def total(name: str) -> float:
        if name not in memo:
            memo[name] = 0.0  # a computation never calls itself; guards a cycle
            memo[name] = sum(
                _line_bytes(line, devices, total, bodies)
                for line in bodies.get(name, [])
            )
        return memo[name]

    return total(entry) if entry else 0.0


def _line_bytes(
    line: str,
    devices: int,
    total: Callable[[str], float],
    bodies: dict[str, list[str]],
) -> float:
    """The bytes `line` sends, and those of the computations it calls."""
    sent = 0.0
    op = _OP.search(line)
    if op is not None:
        n = _group_size(line, devices)
        if n > 1:
            b = _bytes(op.group("type"))
            kind = op.group("op")
            factor = {
                "all-reduce": 2 * (n - 1) / n,
                "all-gather": (n - 1) / n,
                "all-to-all": (n - 1) / n,
                "reduce-scatter": n - 1,
                "collective-permute": 1.0,
            }[kind]
            sent += b * factor
    times = loop_trips(line, bodies) if " while(" in line else 1
    called = [c for c in _CALLED.findall(line) if op is None]
    branches = _BRANCHES.search(line)
    if branches is not None:
        names = [
            n.strip().lstrip("%") for n in branches.group(1).split(",") if n.strip()
        ]
        sent += max((total(n) for n in names), default=0.0)
    sent += times * sum(total(c) for c in called)
    return sent


_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_COMPARE = re.compile(
    r"^ROOT\s+%?[\w.\-]+\s*=\s*pred\[\]\S*\s+compare\(%?([\w.\-]+),\s*%?([\w.\-]+)\)"
    r".*\bdirection=(LT|LE|GT|GE)\b"
)
_DEFINITION = re.compile(r"^%?([\w.\-]+)\s*=\s*\S+\s+([a-z][\w\-]*)\((.*?)\)")


def loop_trips(line: str, bodies: dict[str, list[str]]) -> int:
    """How many times the ``while`` of `line` runs its body: XLA's
    ``known_trip_count`` where it gives one (XLA:CPU, XLA:GPU); else, read
    from its condition (XLA:TPU prints none), a counter against a constant
    (``i < N``, as JAX's scans and fori_loops write them: from 0, by 1);
    else once."""
    known = _TRIPS.search(line)
    if known is not None:
        return int(known.group(1))
    condition = _CONDITION.search(line)
    lines = bodies.get(condition.group(1), []) if condition else []
    root = next((_COMPARE.match(x) for x in lines if x.startswith("ROOT")), None)
    if root is None:
        return 1
    defined = {d.group(1): d for d in map(_DEFINITION.match, lines) if d}
    left, right, direction = root.groups()

    def constant(name: str) -> int | None:
        found = defined.get(name)
        if found is None or found.group(2) != "constant":
            return None
        value = found.group(3).strip()
        return int(value) if re.fullmatch(r"-?\d+", value) else None

    bound = constant(right)
    if bound is None:  # N > i: the same loop
        bound, direction = constant(left), {"GT": "LT", "GE": "LE"}.get(direction)
    if bound is None or direction not in ("LT", "LE"):
        return 1
    return max(bound + (direction == "LE"), 1)


def _group_size(line: str, devices: int) -> int:
    listed = _GROUPS_LIST.search(line)
    if listed is not None:
        return len([x for x in listed.group(1).split(",") if x])
    named = _GROUPS_MESH.search(line)
    if named is not None:
        sizes = {name: int(size) for name, size in _AXIS.findall(named.group(1))}
        return math.prod(
            sizes.get(a, 1) for a in re.findall(r"'([^']+)'", named.group(2))
        )
    iota = _GROUPS_IOTA.search(line)
    if iota is not None:
        return int(iota.group(2))
    if "collective-permute" in line:
        return 2  # pairs: each device sends its payload once
    return devices  # replica_groups={}: every device


def _bytes(shape_text: str) -> int:
    """The bytes of the arrays of `shape_text` (one array's, or a tuple's)."""
    return _sum_bytes(shape_text, device_memory_only=False)


def hbm_bytes(shape_text: str) -> int:
    """The bytes of those arrays of `shape_text` in the device's main
    memory: XLA:TPU places some in on-chip memory (``S(1)`` in their
    layout, its vector memory), which costs no memory traffic."""
    return _sum_bytes(shape_text, device_memory_only=True)


def _sum_bytes(shape_text: str, *, device_memory_only: bool) -> int:
    total = 0
    for found in _ARRAY.finditer(shape_text):
        dtype, dims = found.groups()
        if device_memory_only:
            layout = _LAYOUT.match(shape_text, found.end())
            space = _SPACE.search(layout.group()) if layout else None
            if space is not None and space.group(1) != "0":
                continue
        bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype.split("e")[0]) or 8)
        size = math.prod(int(d) for d in dims.split(",") if d)
        total += size * bits // 8
    return total


def _computations(hlo: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        stripped = line.strip()
        if current is None:
            match = _COMPUTATION.match(stripped)
            if match is not None and "->" in stripped:
                current = match.group(1)
                found[current] = []
        elif stripped == "}":
            current = None
        else:
            found[current].append(stripped)
    return found


def _entry(hlo: str) -> str | None:
    for line in hlo.splitlines():
        if line.startswith("ENTRY"):
            match = _COMPUTATION.match(line.strip())
            return None if match is None else match.group(1)
    return None
