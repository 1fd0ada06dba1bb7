"""Sharding rules: where each array of a model is split over a mesh, said by
its path in the model.

A rule is a regular expression and a layout: the first rule whose pattern
`re.fullmatch`es a leaf's path (``"blocks.layers.weight"``: the
`jax.tree_util.keystr` of its place in the model, dots between the parts)
gives the leaf's `PartitionSpec`. This module checks the rules as written
(`check_rules`, at construction) and against a model's shapes and the mesh
(`RuleBook.spec`, before any array is placed); it places nothing.
"""

import dataclasses
import difflib
import math
import re
from collections.abc import Sequence
from typing import Any, TypeAlias

import jax
from jax.sharding import PartitionSpec as P


# One dimension's entry of a rule's layout: whole (None), split over an axis,
# or over several axes at once (their product).
Entry: TypeAlias = str | tuple[str, ...] | None
Rule: TypeAlias = tuple[str, tuple[Entry, ...]]


def path_name(path: Sequence[Any]) -> str:
    """A leaf's path as rules match it: ``"blocks.layers.0.weight"``."""
    return jax.tree_util.keystr(tuple(path), simple=True, separator=".")


@dataclasses.dataclass(frozen=True)
class CheckedRule:
    """A rule as written, with its pattern compiled."""

    pattern: str
    spec: tuple[Entry, ...]
    regex: re.Pattern[str]

    def __repr__(self) -> str:
        return f"({self.pattern!r}, {self.spec!r})"


def check_rules(rules: object, axes: Sequence[str]) -> tuple[CheckedRule, ...]:
    """`rules` as `MeshStrategy` takes them, checked as written.

    Raises:
        TypeError: `rules` is not a sequence of (pattern, spec) pairs.
        ValueError: a pattern is not a regular expression, or a spec names an
            axis the mesh does not have, or one twice.
    """
    example = '[("blocks.layers.attention.*weight", (None, None, "tensor"))]'
    if isinstance(rules, str | bytes) or not isinstance(rules, Sequence):
        raise TypeError(
            f"rules={rules!r} must be a sequence of (pattern, spec) pairs, "
            f"e.g. rules={example}"
        )
    checked = []
    for rule in rules:
        if (
            not isinstance(rule, tuple | list)
            or len(rule) != 2
            or not isinstance(rule[0], str)
            or not isinstance(rule[1], tuple | list)
        ):
            raise TypeError(
                f"rules: {rule!r} is not a (pattern, spec) pair: a regular "
                "expression matched against a parameter's path and a tuple with "
                f"an entry per dimension, e.g. rules={example}"
            )
        pattern, spec = rule[0], tuple(rule[1])
        try:
            regex = re.compile(pattern)
        except re.error as error:
            raise ValueError(
                f"rules: {pattern!r} is not a regular expression ({error}); "
                "escape literal dots or brackets, e.g. r'layers\\.0\\.weight'"
            ) from None
        named = []
        for entry in spec:
            names = _entry_axes(entry)
            if names is None or any(name not in axes for name in names):
                raise ValueError(
                    f"rules: ({pattern!r}, {spec!r}): {entry!r} is not a mesh "
                    f"axis; each entry is None, one of {tuple(axes)}, or a tuple "
                    "of them"
                )
            named += names
        if len(set(named)) != len(named):
            raise ValueError(
                f"rules: ({pattern!r}, {spec!r}) names an axis twice; split each "
                "array over an axis at most once"
            )
        checked.append(CheckedRule(pattern, spec, regex))
    return tuple(checked)


def _entries_fix(rule: CheckedRule, shape: tuple[int, ...], stacked: bool) -> str:
    """How to give `rule` an entry per dimension of a leaf of `shape`: for
    an array of a `Stacked` (`stacked`), with its layer axis counted."""
    if not stacked:
        return (
            "give one per dimension (None: whole), or a pattern that does not match it"
        )
    layers = (
        "it is an array of a px.models.Stacked, whose first axis holds its "
        f"{shape[0]} layers"
    )
    if len(rule.spec) == len(shape) - 1:  # written for one layer
        fixed = CheckedRule(rule.pattern, (None, *rule.spec), rule.regex)
        return (
            f"{layers}: give that axis an entry too (None: whole, each layer "
            f"gathered on its turn), e.g. {fixed!r}"
        )
    return (
        f"{layers} and takes an entry too (None: whole); give one per "
        "dimension, or a pattern that does not match it"
    )


def _entry_axes(entry: object) -> tuple[str, ...] | None:
    """The axes one entry names, or None if it is not an entry."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple) and all(isinstance(e, str) for e in entry):
        return entry
    return None


@dataclasses.dataclass
class RuleBook:
    """The rules applied to one model: which rule each leaf took, so that a
    rule taken by none can be reported with the paths it might have meant."""

    rules: tuple[CheckedRule, ...]
    sizes: dict[str, int]
    used: set[int] = dataclasses.field(default_factory=set)
    # The paths the rules were matched against, in the model's order.
    paths: list[str] = dataclasses.field(default_factory=list)

    def spec(
        self, path: str, shape: tuple[int, ...], stacked: bool = False
    ) -> P | None:
        """The layout of the leaf at `path`, of `shape`, by the first rule
        matching it; None if none does. `stacked`: the leaf is an array of a
        `px.models.Stacked`, its first axis the layers' (which a rule
        written for one layer leaves out).

        Raises:
            ValueError: the rule has an entry per dimension other than the
                leaf's, or splits a dimension its axes' sizes do not divide.
        """
        self.paths.append(path)
        for index, rule in enumerate(self.rules):
            if not rule.regex.fullmatch(path):
                continue
            self.used.add(index)
            if len(rule.spec) != len(shape):
                raise ValueError(
                    f"rules: {rule!r} matches {path!r} of shape {list(shape)}, "
                    f"but has {len(rule.spec)} entries for its {len(shape)} "
                    f"dimensions; {_entries_fix(rule, shape, stacked)}"
                )
            for entry, length in zip(rule.spec, shape, strict=True):
                parts = math.prod(self.sizes[a] for a in _entry_axes(entry) or ())
                if length % parts:
                    raise ValueError(
                        f"rules: {rule!r} splits {path!r} of shape {list(shape)} "
                        f"{parts} ways along a dimension of {length} (mesh "
                        f"{self.sizes}); choose axes whose sizes divide it, or "
                        "None there"
                    )
            return P(*rule.spec)
        return None

    def check_all_used(self) -> None:
        """Raises ValueError naming a rule that matched no leaf, and the
        model's paths nearest to its pattern."""
        for index, rule in enumerate(self.rules):
            if index not in self.used:
                raise ValueError(
                    f"rules: {rule!r} matches no parameter of the model (by "
                    f"re.fullmatch of its path); {self._nearest(rule.pattern)}: "
                    "fix the pattern, or remove the rule"
                )

    def _nearest(self, pattern: str) -> str:
        """The model's paths closest to `pattern` read as text, e.g. "its
        nearest paths are 'blocks.layers.up.weight', ..."."""
        if not self.paths:
            return "the model has no floating array for a rule to split"
        # r"blocks\.0\.up" read as the path it spells: blocks.0.up.
        text = re.sub(r"\\(.)", r"\1", pattern)
        near = difflib.get_close_matches(text, self.paths, n=3, cutoff=0.0)
        return f"its nearest paths are {', '.join(map(repr, near))}"
