"""mkdocs hook: the top-level names re-exported from a subpackage
(`phalanx.ShardingStrategy` is `phalanx.strategies.ShardingStrategy`) are
documented once, on the subpackage's API page; this hook makes
``[`phalanx.ShardingStrategy`][]`` and ``[`phalanx.Strategy.reduce`][]``
link there too, for the name and each of its members.

mkdocstrings registers only the rendered path (and the defining module's):
griffe resolves `phalanx.X` lazily, since no `__all__` exports it.
"""

import ast
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.pages import Page


_STUB = Path(__file__).resolve().parent.parent / "src" / "phalanx" / "__init__.pyi"


def top_level_reexports(stub: Path = _STUB) -> dict[str, str]:
    """`{"phalanx.strategies.X": "phalanx.X"}` for each ``from .sub import X``
    of the top-level stub whose `sub` is a public subpackage."""
    aliases = {}
    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            if node.module.startswith("_"):
                continue
            for name in node.names:
                public = name.asname or name.name
                aliases[f"phalanx.{node.module}.{name.name}"] = f"phalanx.{public}"
    return aliases


_ALIASES = top_level_reexports()
_ID = re.compile(r'\bid="(phalanx\.[\w.]+)"')


def on_page_content(html: str, page: Page, config: MkDocsConfig, **kwargs) -> str:
    autorefs = config.plugins["autorefs"]
    for anchor in _ID.findall(html):
        for path, alias in _ALIASES.items():
            if anchor == path or anchor.startswith(path + "."):
                autorefs.register_anchor(  # type: ignore[attr-defined]
                    page, alias + anchor[len(path) :], anchor, primary=False
                )
    return html
