"""Getting started's "The trainer on one screen" stays true to the code:
its block names every argument of the trainer and of `fit`, `evaluate` and
`predict` with its default, and the signatures the list below it shows are
the methods' own. (test_docs.py runs the block.)"""

import ast
import inspect
import re
from pathlib import Path

import phalanx as px


ROOT = Path(__file__).resolve().parent.parent.parent
PAGE = ROOT / "docs" / "getting-started.md"
Trainer = px.DataParallelTrainer


def _section() -> str:
    text = PAGE.read_text()
    match = re.search(r"^## The trainer on one screen\n(.*?)^## ", text, re.S | re.M)
    assert match, f"{PAGE} has no section 'The trainer on one screen'"
    return match[1]


def _block() -> ast.Module:
    match = re.search(r"^```python\n(.*?)^```", _section(), re.S | re.M)
    assert match, "the section has no Python block"
    return ast.parse(match[1])


def _keywords(function) -> dict[str, object]:
    """A function's keyword-only parameters, each with its default."""
    return {
        name: parameter.default
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }


def _positional(function) -> list[str]:
    return [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and name != "self"
    ]


def _calls(block: ast.Module) -> dict[str, ast.Call]:
    """The block's calls of the trainer (``"__init__"``) and its methods
    (``trainer.fit(...)``), by the function they call."""
    calls = {}
    for node in ast.walk(block):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr == "DataParallelTrainer":
            calls["__init__"] = node
        elif isinstance(node.func.value, ast.Name) and node.func.value.id == "trainer":
            calls[node.func.attr] = node
    return calls


def test_every_argument_with_its_default():
    calls = _calls(_block())
    assert set(calls) == {"__init__", "fit", "evaluate", "predict"}, sorted(calls)
    for name, call in calls.items():
        method = getattr(Trainer, name)
        where = f"{PAGE.name}, 'The trainer on one screen', {name}"
        assert len(call.args) == len(_positional(method)), (
            f"{where}: {len(call.args)} positional arguments where the signature "
            f"has {_positional(method)}"
        )
        shown = {
            kw.arg: ast.literal_eval(kw.value)
            for kw in call.keywords
            if kw.arg is not None  # None: a **mapping
        }
        assert len(shown) == len(call.keywords), f"{where}: name each argument"
        expected = _keywords(method)
        # Compared as sets: the block may group arguments by topic.
        assert shown.keys() == expected.keys(), (
            f"{where}: missing {sorted(expected.keys() - shown.keys())}, "
            f"not in the signature {sorted(shown.keys() - expected.keys())}"
        )
        wrong = {k: (v, expected[k]) for k, v in shown.items() if v != expected[k]}
        assert not wrong, f"{where}: (shown, real) defaults differ: {wrong}"


def _plain(function) -> str:
    """A method's signature as the page writes it: no ``self``, no
    annotations, ``*`` before the keyword-only parameters."""
    signature = inspect.signature(function)
    parameters = [
        p.replace(annotation=inspect.Parameter.empty)
        for p in signature.parameters.values()
        if p.name != "self"
    ]
    plain = signature.replace(
        parameters=parameters, return_annotation=inspect.Signature.empty
    )
    return f"{function.__name__}{plain}".replace("'", '"')


def test_the_list_shows_the_signatures():
    # Each `name(...)` the list links to its API entry is the method's own.
    shown = re.findall(
        r"\[`(\w+)\(([^`]*)\)`\]\[phalanx\.DataParallelTrainer\.(\w+)\]",
        _section().replace("\n", " "),
    )
    assert {name for name, _, _ in shown} >= {"fit", "evaluate", "predict"}, shown
    for name, arguments, target in shown:
        assert name == target, (name, target)
        assert f"{name}({arguments})" == _plain(getattr(Trainer, name))
