"""The shape of the code, read from its source with `ast`: the import graph of espn/, indexing/
and server/ (installed as espn, espn_indexing, espn_server) has no circle, imports sit at the top
of files, no module reaches into another object's private attributes, asserts only narrow types
(`python -O` strips them), functions and files stay short, the arrows point down (the library
and the server never import the build job), and the Layout of docs/architecture.md lists every
module.

Each test names every violation as `path:line`, so a failure is a to-do list.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
#: Repository folder -> the name it installs under (pyproject.toml's [tool.setuptools.package-dir]).
PACKAGES = {"espn": "espn", "indexing": "espn_indexing", "server": "espn_server"}
#: The most imports of project modules that may sit inside functions (optional extras, entry points).
MAX_FUNCTION_IMPORTS = 15
MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 500
#: Files written by a generator, exempt from the file-size rule (repository paths).
GENERATED: frozenset[str] = frozenset()
#: Private names of the standard library that are its documented interface.
STDLIB_PRIVATE = {("os", "_exit"), ("sys", "_getframe")}
ARCHITECTURE = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Import:
    """One import statement's edge: `source` imports the project module `target` at path:line."""

    source: str
    target: str
    where: str
    in_function: bool
    type_checking: bool


@dataclass
class Module:
    name: str
    path: str  # relative to the repository, e.g. "espn/store/reader.py"
    tree: ast.Module
    lines: list[str]
    comment_lines: set[int] = field(default_factory=set)
    parents: dict[ast.AST, ast.AST] = field(default_factory=dict)


def _module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    parts[0] = PACKAGES[parts[0]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=1)
def project() -> dict[str, Module]:
    """Every module of the three packages, parsed once for all the tests of this file."""
    modules = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT)
            source = path.read_text(encoding="utf-8")
            module = Module(_module_name(relative), str(relative), ast.parse(source), source.splitlines())
            tokens = tokenize.generate_tokens(io.StringIO(source).readline)
            module.comment_lines = {tok.start[0] for tok in tokens if tok.type == tokenize.COMMENT}
            module.parents = {child: node for node in ast.walk(module.tree) for child in ast.iter_child_nodes(node)}
            modules[module.name] = module
    return modules


def _ancestors(module: Module, node: ast.AST) -> Iterator[ast.AST]:
    while node in module.parents:
        node = module.parents[node]
        yield node


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
           (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _project_module(name: str) -> Optional[str]:
    """The longest prefix of `name` that is a project module (None outside the project)."""
    modules = project()
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _resolve(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.name.split(".")
    if not module.path.endswith("__init__.py"):
        package.pop()
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@functools.lru_cache(maxsize=1)
def imports() -> list[Import]:
    """Every import of a project module by a project module, with where it sits. `from X import y`
    counts as importing X.y when that is a module, else X (as import-linter counts them)."""
    found = []
    for module in project().values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Import):
                targets = [_project_module(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, node)
                targets = [_project_module(f"{base}.{alias.name}") if f"{base}.{alias.name}" in project()
                           else _project_module(base) for alias in node.names]
            else:
                continue
            ancestors = list(_ancestors(module, node))
            in_function = any(isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) for a in ancestors)
            type_checking = any(isinstance(a, ast.If) and _is_type_checking(a.test) for a in ancestors)
            for target in dict.fromkeys(t for t in targets if t is not None):
                found.append(Import(module.name, target, f"{module.path}:{node.lineno}", in_function, type_checking))
    return sorted(found, key=lambda edge: _line_order(edge.where))


def _line_order(where: str) -> tuple[str, int]:
    path, line = where.split(":")[:2]
    return path, int(line)


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:  # Tarjan; the graph has ~100 nodes, recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(components)


def _report(title: str, violations: list[str], count: Optional[int] = None) -> str:
    return f"{len(violations) if count is None else count} {title}:\n  " + "\n  ".join(violations)


def test_no_import_circles_counting_imports_inside_functions() -> None:
    runtime = [edge for edge in imports() if not edge.type_checking and edge.source != edge.target]
    edges: dict[str, set[str]] = {}
    for edge in runtime:
        edges.setdefault(edge.source, set()).add(edge.target)
    circles = _circles(edges)
    lines = []
    for members in circles:
        inside = set(members)
        lines.append("circle of " + ", ".join(members) + ":")
        lines += [f"    {e.where}: {e.source} -> {e.target}{' (in a function)' if e.in_function else ''}"
                  for e in runtime if e.source in inside and e.target in inside]
    assert not circles, _report("import circles among project modules", lines, len(circles))


def test_few_imports_inside_functions_each_saying_why() -> None:
    inner = [edge for edge in imports() if edge.in_function]
    modules = {module.path: module for module in project().values()}
    silent = []
    for edge in inner:
        path, line = edge.where.rsplit(":", 1)
        if not {int(line), int(line) - 1} & modules[path].comment_lines:
            silent.append(f"{edge.where}: {edge.source} imports {edge.target} in a function with no comment saying why")
    listing = [f"{edge.where}: {edge.source} -> {edge.target}" for edge in inner]
    assert len(inner) <= MAX_FUNCTION_IMPORTS, _report(
        f"imports of project modules inside functions (at most {MAX_FUNCTION_IMPORTS}: optional extras and the "
        "entry-point registration)", listing)
    assert not silent, _report("imports inside functions without a comment on their line or the line above", silent)


def _private_uses(module: Module) -> Iterator[str]:
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or (owner.id, node.attr) in STDLIB_PRIVATE):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id in ("super", "type"):
                continue  # super()._x and type(self)._x are the object's own
            yield f"{module.path}:{node.lineno}: {ast.unparse(owner)}.{node.attr}"
        elif isinstance(node, ast.ImportFrom):
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private and _project_module(_resolve(module, node)):
                yield f"{module.path}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {', '.join(private)}"


def test_no_module_reads_another_objects_private_attributes() -> None:
    """`x._name` with x other than self/cls (a module's private function included), and
    `from module import _name`; name-mangled and dunder names aside, os._exit and sys._getframe aside."""
    found = sorted((use for module in project().values() for use in _private_uses(module)), key=_line_order)
    assert not found, _report("uses of another object's private attribute", found)


def test_no_function_over_80_lines() -> None:
    long = [f"{module.path}:{node.lineno}: {node.name} is {node.end_lineno - node.lineno + 1} lines"
            for module in project().values() for node in ast.walk(module.tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, _report(f"functions over {MAX_FUNCTION_LINES} lines (def to last line)", long)


def test_no_file_over_500_lines() -> None:
    big = [f"{module.path}:1: {len(module.lines)} lines" for module in project().values()
           if len(module.lines) > MAX_FILE_LINES and module.path not in GENERATED]
    assert not big, _report(f"files over {MAX_FILE_LINES} lines", big)


def _narrows_a_type(test: ast.expr) -> bool:
    """`x is not None`, `isinstance(x, T)`, or an `and` of them: what mypy reads, nothing more."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return all(_narrows_a_type(value) for value in test.values)
    if isinstance(test, ast.Compare):
        return len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot) and \
            isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None
    return isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance"


def test_asserts_only_narrow_types_for_the_checker() -> None:
    """`python -O` strips assert statements, so no check the service relies on (a bound, a time
    limit, an invariant of the data) may live in one; an assert may only tell mypy a type."""
    checks = [f"{module.path}:{node.lineno}: assert {ast.unparse(node.test)}" for module in project().values()
              for node in ast.walk(module.tree) if isinstance(node, ast.Assert) and not _narrows_a_type(node.test)]
    assert not checks, _report("asserts that check more than a type (raise an error instead)", checks)


def test_the_library_and_the_server_never_import_the_build_job() -> None:
    """`espn index` joins the CLI through pyproject.toml's `espn.commands` entry points, not an import."""
    upward = [f"{edge.where}: {edge.source} imports {edge.target}" for edge in imports()
              if edge.target.split(".")[0] == "espn_indexing" and edge.source.split(".")[0] in ("espn", "espn_server")]
    assert not upward, _report("imports of espn_indexing from espn/ or server/", upward)


#: What the server (espn_server, the router included) may import from the library: its one door and its errors.
SERVER_DOOR = ("espn.engine", "espn.errors")
#: The most names the server may take from the door.
MAX_DOOR_NAMES = 25


def test_the_server_imports_from_the_library_only_its_door_and_errors() -> None:
    """espn.engine is the library as the server sees it (a registry of engines, the dataclasses
    they take and give, the rules of what arrives from outside): the server reaches no module
    behind it, in functions and type-only imports too, takes few names from it, and the door
    is a module of names, not a lazy bag (no module-level __getattr__)."""
    behind = [f"{edge.where}: {edge.source} imports {edge.target}" for edge in imports()
              if edge.source.split(".")[0] == "espn_server" and edge.target.split(".")[0] == "espn"
              and edge.target not in SERVER_DOOR]
    assert not behind, _report(f"imports of the library from server/ other than {' and '.join(SERVER_DOOR)}", behind)
    taken = sorted({alias.name for module in project().values() if module.name.startswith("espn_server")
                    for node in ast.walk(module.tree) if isinstance(node, ast.ImportFrom)
                    and _resolve(module, node) == SERVER_DOOR[0] for alias in node.names})
    assert len(taken) <= MAX_DOOR_NAMES, f"server/ takes {len(taken)} names from {SERVER_DOOR[0]}: {taken}"
    door = project()[SERVER_DOOR[0]]
    lazy = [f"{door.path}:{node.lineno}" for node in door.tree.body
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"]
    assert not lazy, f"a module-level __getattr__ in the door: {lazy}"


def _unit(module: str) -> Optional[str]:
    """The first-level unit of the library a module belongs to (espn.search.dense -> search)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "espn" and len(parts) > 1 else None


def _layers() -> dict[str, int]:
    """unit -> layer, from the numbered list between `<!-- layers -->` markers of architecture.md."""
    block = re.search(r"<!-- layers -->\n(.*?)\n<!-- /layers -->", ARCHITECTURE.read_text(encoding="utf-8"), re.S)
    assert block, f"{ARCHITECTURE.relative_to(ROOT)}: no <!-- layers --> list"
    layers = {}
    for line in block.group(1).splitlines():
        number, _, units = line.partition(". ")
        for unit in units.split(","):
            layers[unit.strip()] = int(number)
    return layers


def test_the_librarys_units_import_only_units_of_lower_layers() -> None:
    """The layer order of architecture.md: no import up or sideways between first-level units of
    espn/ (type-only imports aside), every unit listed, so no strongly connected set of units."""
    layers = _layers()
    units = {unit for module in project() if (unit := _unit(module)) is not None}
    unlisted = sorted(units - set(layers))
    assert not unlisted, f"units of espn/ missing from the layers of docs/architecture.md: {unlisted}"
    wrong = []
    for edge in imports():
        source, target = _unit(edge.source), _unit(edge.target)
        if edge.type_checking or source is None or target is None or source == target:
            continue
        if layers[target] >= layers[source]:
            wrong.append(f"{edge.where}: {source} (layer {layers[source]}) imports {target} (layer {layers[target]})")
    assert not wrong, _report("imports between units of espn/ that do not go down a layer", wrong)
    edges: dict[str, set[str]] = {}
    for edge in imports():
        source, target = _unit(edge.source), _unit(edge.target)
        if not edge.type_checking and source and target and source != target:
            edges.setdefault(source, set()).add(target)
    assert not _circles(edges), _report("strongly connected sets of units", [str(c) for c in _circles(edges)])


def _layout_paths(text: str) -> set[str]:
    """The repository paths named by the tree in architecture.md's generated layout block."""
    block = re.search(r"<!-- generated:layout -->\n```text\n(.*?)\n```\n<!-- /generated -->", text, re.S)
    assert block, f"{ARCHITECTURE.relative_to(ROOT)}: no generated:layout block with a text code block"
    paths, stack = set(), []
    for line in block.group(1).splitlines():
        name = line.split()[0]
        depth = (len(line) - len(line.lstrip(" "))) // 2
        stack[depth:] = [name.rstrip("/")]
        paths.add("/".join(stack) + ("/__init__.py" if name.endswith("/") else ""))
    return paths


def test_the_architecture_layout_lists_every_module() -> None:
    listed = _layout_paths(ARCHITECTURE.read_text(encoding="utf-8"))
    missing = sorted(f"{module.path}:1: not in the Layout of docs/architecture.md" for module in project().values()
                     if module.path not in listed)
    gone = sorted(f"docs/architecture.md: {path} is listed but does not exist" for path in listed
                  if not (ROOT / path).is_file())
    assert not missing + gone, _report("differences between the Layout and the code (run `make docs`)",
                                       missing + gone)
