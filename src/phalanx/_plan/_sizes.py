"""Sizes in bytes as people write them (``"16GiB"``, ``"500 MB"``): read by
`px.plan`'s ``budget`` and ``phalanx plan --budget`` (no JAX here: the
command line's parser imports this)."""

import re


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
HOW = "an int of bytes, or a string such as '16GiB', '512MiB' or '2.5GB'"


def parse_size(text: str) -> int:
    """The bytes `text` says (a number and an optional unit: B, KB, MB, GB,
    TB in powers of 1000, KiB, MiB, GiB, TiB in powers of 1024).

    Raises:
        ValueError: `text` is not a positive size.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = None if match is None else _UNITS.get(match.group(2).lower())
    if match is None or unit is None or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a positive size; write {HOW}")
    return int(float(match.group(1)) * unit)
