"""The documentation site's generated parts, from the code that defines them.

- docs/reference/cli.md: `espn --help` and `espn CMD --help` of every subcommand, from the
  argument parsers (espn.cli.build_parser, which the subcommands of espn_indexing and
  espn_server join through the `espn.commands` entry point);
- docs/reference/settings.md: the settings tables (settings_doc.py);
- docs/reference/openapi.json and the operations of docs/reference/http-api.md: the OpenAPI
  document of a server with its default settings and no API key, rendered as Markdown, so
  the page reads offline with no JavaScript renderer;
- the request limits of docs/guides/operating-limits.md: each limit of the library (and so of
  the command line) beside the HTTP one, read from the constants that define them;
- the Layout of docs/architecture.md: a tree of the packages espn/, indexing/ and server/,
  one line per module, from the first sentence of each module's docstring.

Each generated part sits between `<!-- generated:NAME -->` and `<!-- /generated -->` in a
page whose other text is written by hand. `python -m tools.docs_pages docs` rewrites
them (`make docs` does); `--check` exits 1 when one is out of date, and
tests/test_docs_site.py fails in the same case.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from espn.cli import build_parser
from espn.ids import MAX_ID_BYTES
from espn.live.encoding import PAGE_BATCH_SIZE
from espn.pages.decode import MAX_PIXELS, MAX_SIDE_PX
from espn.pages.memory import DEFAULT_PAGE_MEMORY_BYTES, MAX_GROUP_BYTES, PAGE_BYTES_PER_PIXEL, PAGE_MEMORY_WAIT_S
from espn.params import MAX_K, MAX_LEXICAL_K, MAX_QUERY_CHARS
from espn_server.app import build_app
from espn_server.schemas import MAX_HTTP_K, MAX_HTTP_LEXICAL_K
from espn_server.settings import ServerSettings
from espn_server.settings_doc import replace_blocks, write_readme

__all__ = ["cli_reference", "openapi_document", "http_reference", "limits_table", "page_memory_table", "layout_tree",
           "write_pages"]

#: argparse wraps --help to the terminal's width: a fixed width keeps the page the same everywhere.
_HELP_COLUMNS = "100"
#: The folders of the layout tree and the names they install under (pyproject.toml's package-dir).
LAYOUT_PACKAGES = {"espn": "espn", "indexing": "espn_indexing", "server": "espn_server"}
#: A module's line in the layout tree keeps its summary under this many characters.
_SUMMARY_CHARS = 110


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """The process environment with `values` set and no ESPN_* variable (the generated pages
    show the defaults, whatever the shell that runs `make docs` has set), restored after."""
    before = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("ESPN_")]:
        del os.environ[name]
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def cli_reference() -> str:
    """Markdown: every subcommand's --help, in the order `espn --help` lists them."""
    with _environment(COLUMNS=_HELP_COLUMNS):
        parser = build_parser()
        parts = ["## espn", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, sub in parser.subcommands.items():
            parts += [f"## espn {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document of `espn serve` with its default settings, no API key and an index
    with no metadata fields (what a server adds from its index is described in the page)."""
    with tempfile.TemporaryDirectory() as index, _environment(ESPN_INDEX=index):
        Path(index, "manifest.json").write_text("{}")
        document = build_app(ServerSettings()).openapi()  # type: ignore[call-arg]  # index from ESPN_INDEX
    document["info"]["version"] = "see /openapi.json of a running server"
    return json.loads(json.dumps(document, sort_keys=True))


def _schema_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema:
        return " or ".join(_schema_name(s) for s in schema["anyOf"])
    if schema.get("type") == "array":
        return f"array of {_schema_name(schema.get('items', {}))}"
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    return str(schema.get("type", "any"))


def _bounds(schema: dict[str, Any]) -> str:
    keys = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "minLength", "maxLength", "minItems",
            "maxItems", "pattern", "default")
    return ", ".join(f"{key} `{json.dumps(schema[key], ensure_ascii=False)}`" for key in keys if key in schema)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _schema_table(schema: dict[str, Any]) -> list[str]:
    properties = schema.get("properties") or {}
    if not properties:
        return [_cell(schema.get("description", "")) or "(no fields)", ""]
    required = set(schema.get("required") or ())
    rows = ["| field | type | required | bounds and default | description |", "|---|---|---|---|---|"]
    for name, field in properties.items():
        rows.append(f"| `{name}` | {_schema_name(field)} | {'yes' if name in required else ''} | "
                    f"{_cell(_bounds(field))} | {_cell(field.get('description', ''))} |")
    return rows + [""]


def _operation(path: str, method: str, operation: dict[str, Any]) -> list[str]:
    lines = [f"### {method.upper()} `{path}`", "", f"**{operation.get('summary', '')}**", ""]
    if operation.get("description"):
        lines += [operation["description"].strip(), ""]
    parameters = operation.get("parameters") or []
    if parameters:
        lines += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for p in parameters:
            lines.append(f"| `{p['name']}` | {p['in']} | {_schema_name(p.get('schema', {}))} | "
                         f"{'yes' if p.get('required') else ''} | {_cell(p.get('description', ''))} |")
        lines.append("")
    body = (operation.get("requestBody") or {}).get("content", {}).get("application/json")
    if body:
        lines += [f"Request body (`application/json`): {_schema_name(body['schema'])}", ""]
    lines += ["| status | body | meaning |", "|---|---|---|"]
    for status, response in sorted(operation.get("responses", {}).items()):
        content = (response.get("content") or {}).get("application/json", {})
        lines.append(f"| {status} | {_schema_name(content['schema']) if content.get('schema') else ''} | "
                     f"{_cell(response.get('description', ''))} |")
    return lines + [""]


def http_reference(document: dict[str, Any]) -> str:
    """Markdown: each operation (parameters, body, every status) and each schema of `document`."""
    lines = ["## Operations", ""]
    order = ("/v1/search", "/v1/documents", "/v1/snapshots")  # then the operational endpoints
    paths = sorted(document["paths"].items(),
                   key=lambda item: (next((i for i, p in enumerate(order) if item[0].startswith(p)), len(order)),
                                     item[0]))
    for path, item in paths:
        for method, operation in item.items():
            lines += _operation(path, method, operation)
    lines += ["## Schemas", ""]
    for name, schema in sorted(document.get("components", {}).get("schemas", {}).items()):
        lines += [f"### {name}", ""]
        if schema.get("description") and schema.get("properties"):
            lines += [_cell(schema["description"]), ""]
        lines += _schema_table(schema)
    return "\n".join(lines)


def limits_table() -> str:
    """Markdown: the limits a request meets in the library (and `espn search`, `espn add`) and over
    HTTP, one row per concept; where they differ, the HTTP constant has its own name and why."""
    rows = [
        ("query text", f"{MAX_QUERY_CHARS:,} characters", "the same", "`espn.params.MAX_QUERY_CHARS`", ""),
        ("document id", f"{MAX_ID_BYTES:,} UTF-8 bytes", "the same, refused in the library's words",
         "`espn.ids.MAX_ID_BYTES`", ""),
        ("results per query (`k`)", f"{MAX_K:,}", f"{MAX_HTTP_K:,}", "`espn.params.MAX_K`, "
         "`espn_server.schemas.MAX_HTTP_K`", "a response is built whole in memory and sent as one JSON body, and "
         "a batch multiplies it"),
        ("lexical candidates (`lexical_k`)", f"{MAX_LEXICAL_K:,}", f"{MAX_HTTP_LEXICAL_K:,}",
         "`espn.params.MAX_LEXICAL_K`, `espn_server.schemas.MAX_HTTP_LEXICAL_K`",
         "each is read and MaxSim-scored within the request, and `espn route` asks every partition for its "
         "whole pool"),
    ]
    lines = ["| limit | library and CLI | HTTP | constants | why HTTP differs |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines)


def page_memory_table() -> str:
    """Markdown: the memory bounds of page images (espn.pages.memory), each from its constant."""
    page = MAX_PIXELS * PAGE_BYTES_PER_PIXEL
    rows = [
        ("one page's pixels", f"{MAX_PIXELS:,} px, {MAX_SIDE_PX:,} px a side, from its header before any pixel is "
         "decoded", "`espn.pages.decode.MAX_PIXELS`, `MAX_SIDE_PX`", "refused: 422 `invalid_parameter` for a write, "
         "one line for `espn index`"),
        ("what one page costs", f"{PAGE_BYTES_PER_PIXEL} bytes a pixel at its peak (decoding, the stored JPEG, the "
         f"model's processor): {page / 1e6:,.0f} MB for a page of {MAX_PIXELS / 1e6:.0f} MP",
         "`espn.pages.memory.PAGE_BYTES_PER_PIXEL`", "what the two bounds below count"),
        ("pages decoded together (a request's group, the build's)", f"{MAX_GROUP_BYTES >> 20:,} MiB of page cost "
         f"and {PAGE_BATCH_SIZE} pages for a write (`--batch-size` for `espn index`); a page over it alone",
         "`espn.pages.memory.MAX_GROUP_BYTES`, `espn.live.encoding.PAGE_BATCH_SIZE`",
         "the next group waits until this one is encoded"),
        ("a worker's page memory, every write and index together", f"{DEFAULT_PAGE_MEMORY_BYTES >> 20:,} MiB "
         "(`--page-memory-bytes`)", "`espn.pages.memory.DEFAULT_PAGE_MEMORY_BYTES`", "a page that alone costs more: "
         f"413 `too_large`; a group that waits over {PAGE_MEMORY_WAIT_S:g} s for others: 503 `write_failed` with "
         "`Retry-After`"),
    ]
    lines = ["| bound | value | constant | past it |", "|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines)


def _summary(path: Path) -> str:
    """The first sentence of a module's docstring, on one line, cut at a word near _SUMMARY_CHARS."""
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(docstring.split("\n\n", 1)[0].split())
    sentence = re.match(r"(.*?[.!?])(?:\s|$)", paragraph)
    text = sentence.group(1) if sentence else paragraph
    if len(text) > _SUMMARY_CHARS:
        text = text[:_SUMMARY_CHARS].rsplit(" ", 1)[0].rstrip(",;:") + " …"
    return text or "(no docstring)"


def _layout_rows(folder: Path, depth: int) -> list[tuple[str, str]]:
    """(indented name, summary) for the modules and subpackages of `folder`, in name order."""
    rows: list[tuple[str, str]] = []
    for path in sorted(folder.iterdir()):
        if path.is_dir() and (path / "__init__.py").is_file():
            rows.append(("  " * depth + path.name + "/", _summary(path / "__init__.py")))
            rows += _layout_rows(path, depth + 1)
        elif path.suffix == ".py" and path.name != "__init__.py":
            rows.append(("  " * depth + path.name, _summary(path)))
    return rows


def layout_tree(repo: Path) -> str:
    """Markdown: a code block with one line per module of espn/, indexing/ and server/ (a package's
    line is its __init__.py), each with the first sentence of the module's docstring."""
    rows: list[tuple[str, str]] = []
    for folder, installed in LAYOUT_PACKAGES.items():
        summary = _summary(repo / folder / "__init__.py")
        rows.append((folder + "/", summary if folder == installed else f"[{installed}] {summary}"))
        rows += _layout_rows(repo / folder, 1)
    width = max(len(name) for name, _ in rows) + 2
    return "\n".join(["```text", *(f"{name:<{width}}{summary}".rstrip() for name, summary in rows), "```"])


def write_pages(docs: Path, check: bool = False) -> list[Path]:
    """Rewrite the generated blocks under `docs` (and openapi.json); the files that changed (or would).
    The layout tree is read from the repository that holds `docs`."""
    document = openapi_document()
    pages = {docs / "reference" / "cli.md": {"cli": cli_reference()},
             docs / "reference" / "http-api.md": {"operations": http_reference(document)},
             docs / "guides" / "operating-limits.md": {"limits": limits_table(), "page_memory": page_memory_table()},
             docs / "architecture.md": {"layout": layout_tree(docs.resolve().parent)}}
    changed = [path for path, blocks in pages.items() if replace_blocks(path, blocks, "generated", check)]
    settings = docs / "reference" / "settings.md"  # its own markers and writer (settings_doc)
    if write_readme(settings, check=check):
        changed.append(settings)
    openapi = json.dumps(document, indent=1, ensure_ascii=False) + "\n"
    target = docs / "reference" / "openapi.json"
    if not target.exists() or target.read_text(encoding="utf-8") != openapi:
        changed.append(target)
        if not check:
            target.write_text(openapi, encoding="utf-8")
    return changed


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docs_pages", description=__doc__.split("\n\n")[0])
    parser.add_argument("docs", type=Path, help="the docs/ folder")
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated part is out of date")
    args = parser.parse_args(argv)
    changed = write_pages(args.docs, check=args.check)
    for path in changed:
        print(f"{path}: {'out of date; run `make docs`' if args.check else 'updated'}",
              file=sys.stderr if args.check else sys.stdout)
    return 1 if (changed and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
