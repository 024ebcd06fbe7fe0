"""The indexes `espn serve` holds, by name: `--index NAME=PATH`, `--index PATH`, `--index DIR`.

Resolved here from the settings' `index` (INDEX, the default index) and `indexes` entries;
server.indexes serves each name under /v1/indexes/{name}/.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

__all__ = ["DEFAULT_INDEX_NAME", "INDEX_NAME", "resolve_indexes", "split_entries", "default_index_path"]

#: The name of INDEX (the default index) when no --index names it.
DEFAULT_INDEX_NAME = "default"
#: What an index's name may be: it is a URL path segment and a directory name.
INDEX_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _index_dir(path: Path) -> Path:
    path = Path(path).expanduser().resolve()
    if not (path / "manifest.json").is_file():
        raise ValueError(f"{path} is not an ESPN index directory (no manifest.json)")
    return path


def resolve_indexes(default: Optional[Path], entries: list[str]) -> dict[str, Path]:
    """name -> index directory of every index served, the default first.

    entries: NAME=PATH, PATH (an index: the default one), or a directory of indexes (each
    subdirectory holding a manifest.json, named after it). `default` (INDEX) is named
    `default` unless an entry names its directory. A name twice, or a bad name, is refused."""
    named: dict[str, Path] = {}

    def add(name: str, path: Path) -> None:
        if not INDEX_NAME.match(name):
            raise ValueError(f"index name {name!r}: letters, digits, '_', '.', '-' (at most 64, not first '.', "
                             "'_' or '-')")
        if name in named and named[name] != path:
            raise ValueError(f"index name {name!r} given twice ({named[name]} and {path})")
        named[name] = path

    for entry in entries:
        name, sep, rest = entry.partition("=")
        if sep and INDEX_NAME.match(name):
            add(name, _index_dir(Path(rest)))
            continue
        path = Path(entry).expanduser().resolve()
        if (path / "manifest.json").is_file():
            add(DEFAULT_INDEX_NAME, path)
        elif path.is_dir():
            found = sorted(child for child in path.iterdir() if (child / "manifest.json").is_file())
            if not found:
                raise ValueError(f"{path}: neither an index (no manifest.json) nor a directory of indexes")
            for child in found:
                add(child.name, child.resolve())
        else:
            raise ValueError(f"--index {entry!r}: expected NAME=PATH, an index directory or a directory of indexes")
    if default is not None:
        default = Path(default)
        names = [name for name, path in named.items() if path == default]
        first = names[0] if names else DEFAULT_INDEX_NAME
        if not names:
            add(DEFAULT_INDEX_NAME, default)
        named = {first: named[first], **{k: v for k, v in named.items() if k != first}}
    return named


def split_entries(value: Any) -> Any:
    """ESPN_INDEXES as a list: a JSON list, or comma-separated entries."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [entry.strip() for entry in text.split(",") if entry.strip()]
    return value


def default_index_path(entries: list[str]) -> Optional[Path]:
    """Without INDEX: the entry named `default`, else the first (None: no entries)."""
    named = resolve_indexes(None, entries)
    return named.get(DEFAULT_INDEX_NAME, next(iter(named.values()))) if named else None
