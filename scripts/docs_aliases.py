"""mkdocs hook: links to where names are documented.

Re-exports: the top-level names re-exported from a subpackage
(`phalanx.ShardingStrategy` is `phalanx.strategies.ShardingStrategy`) are
documented once, on the subpackage's API page; this hook makes
``[`phalanx.ShardingStrategy`][]`` and ``[`phalanx.Strategy.reduce`][]``
link there too, for the name and each of its members. mkdocstrings registers
only the rendered path (and the defining module's): griffe resolves
`phalanx.X` lazily, since no `__all__` exports it.

Type aliases: a public signature names aliases defined in private modules
(``loss: LossName | LossFn``, ``checks: ChecksMode``). The API page of
`phalanx` has a table of every alias and type variable the documented
objects' signatures use, with its definition as the source has it, written
by this hook where the page says ``<!-- type aliases -->``; each alias in a
signature links to its row, never to a private module.
"""

import ast
import html
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import griffe
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
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


# --- type aliases ---------------------------------------------------------------

_SRC = _STUB.parent
_API = _SRC.parent.parent / "docs" / "api"
# The page that holds the table, and where on it.
TYPES_PAGE = "api/phalanx.md"
TYPES_MARKER = "<!-- type aliases -->"


class TypeAlias(NamedTuple):
    name: str  # as signatures show it: "LossName"
    definition: str  # its value in the source: 'Literal["on", "off"]'


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's top-level statements, those under an `if` included."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        else:
            yield node


def private_type_aliases(src: Path = _SRC) -> dict[str, TypeAlias]:
    """Each type alias (``X: TypeAlias = ...``) and type variable
    (``X = TypeVar(...)``) defined at the top level of a private module,
    by its path (``"phalanx._typing.LossName"``); the first definition where
    an ``if TYPE_CHECKING`` gives two."""
    aliases: dict[str, TypeAlias] = {}
    for file in sorted(src.rglob("*.py")):
        parts = file.relative_to(src).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            continue
        module = ".".join(("phalanx", *parts))
        source = file.read_text()
        for node in _top_level(ast.parse(source).body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.value is not None
                and ast.unparse(node.annotation).endswith("TypeAlias")
            ):
                name, value = node.target.id, node.value
            elif (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func).endswith("TypeVar")
            ):
                name, value = node.targets[0].id, node.value
            else:
                continue
            definition = ast.get_source_segment(source, value) or ast.unparse(value)
            aliases.setdefault(f"{module}.{name}", TypeAlias(name, definition))
    return aliases


def api_entries(api: Path = _API) -> list[str]:
    """The objects the API pages document (their ``::: path`` lines)."""
    return [
        match[1]
        for page in sorted(api.glob("*.md"))
        for match in re.finditer(r"^:::\s+(\S+)", page.read_text(), re.M)
    ]


def _annotations(obj: Any) -> Iterator[Any]:
    """The annotations of a documented object and of its public members."""
    if obj.is_alias:
        try:
            obj = obj.final_target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return
    if obj.is_function:
        yield from (parameter.annotation for parameter in obj.parameters)
        yield obj.returns
    elif obj.is_attribute:
        yield obj.annotation
    if obj.is_class or obj.is_module:
        for name, member in obj.members.items():
            if not name.startswith("_") or name == "__init__":
                if not (obj.is_module and member.is_alias):  # imports
                    yield from _annotations(member)


def used_type_aliases(
    aliases: dict[str, TypeAlias], entries: list[str]
) -> dict[str, TypeAlias]:
    """The `aliases` that the signatures of the documented `entries` (and of
    their public members) name, in the order first named, and those their
    definitions name."""
    package = griffe.load(
        "phalanx", search_paths=[str(_SRC.parent)], resolve_aliases=False
    )
    used: dict[str, TypeAlias] = {}
    for entry in entries:
        obj = package[entry.removeprefix("phalanx.")] if entry != "phalanx" else package
        for annotation in _annotations(obj):
            if not isinstance(annotation, griffe.Expr):
                continue
            for part in annotation.iterate(flat=True):
                if isinstance(part, griffe.ExprName):
                    path = part.canonical_path
                    if path in aliases:
                        used.setdefault(path, aliases[path])
    # And the aliases their definitions name (`LossFn` is a Callable
    # returning a `PerExample`), from the same module.
    for path in list(used):
        module = path.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(used[path].definition)):
            named = f"{module}.{node.id}" if isinstance(node, ast.Name) else ""
            if named in aliases:
                used.setdefault(named, aliases[named])
    return used


def type_anchors(used: dict[str, TypeAlias]) -> dict[TypeAlias, str]:
    """The id of each alias's row: its name, made unique where two modules
    define one name differently."""
    anchors: dict[TypeAlias, str] = {}
    for alias in used.values():
        if alias not in anchors:
            taken = sum(a.name == alias.name for a in anchors)
            anchors[alias] = alias.name + (f"-{taken + 1}" if taken else "")
    return anchors


def types_table(anchors: dict[TypeAlias, str]) -> str:
    """The table that replaces `TYPES_MARKER`: each alias and its definition."""
    rows = "".join(
        f'<tr><td><code id="{anchor}">{html.escape(alias.name)}</code></td>'
        f"<td><code>{html.escape(alias.definition)}</code></td></tr>\n"
        for alias, anchor in sorted(anchors.items(), key=lambda item: item[1].lower())
    )
    return (
        "<table>\n<thead><tr><th>Name</th><th>Is</th></tr></thead>\n"
        f"<tbody>\n{rows}</tbody>\n</table>\n"
    )


_USED: dict[str, TypeAlias] = {}


def on_files(files: Files, config: MkDocsConfig, **kwargs: Any) -> Files:
    _USED.clear()
    _USED.update(used_type_aliases(private_type_aliases(), api_entries()))
    return files


def on_page_markdown(
    markdown: str, page: Page, config: MkDocsConfig, **kwargs: Any
) -> str:
    if page.file.src_uri != TYPES_PAGE:
        return markdown
    return markdown.replace(TYPES_MARKER, types_table(type_anchors(_USED)))


def on_page_content(html: str, page: Page, config: MkDocsConfig, **kwargs) -> str:
    autorefs = config.plugins["autorefs"]
    for anchor in _ID.findall(html):
        for path, alias in _ALIASES.items():
            if anchor == path or anchor.startswith(path + "."):
                autorefs.register_anchor(  # type: ignore[attr-defined]
                    page, alias + anchor[len(path) :], anchor, primary=False
                )
    if page.file.src_uri == TYPES_PAGE:
        anchors = type_anchors(_USED)
        for path, alias in _USED.items():
            if f'id="{anchors[alias]}"' in html:
                autorefs.register_anchor(  # type: ignore[attr-defined]
                    page, path, anchors[alias], primary=True
                )
    return html
