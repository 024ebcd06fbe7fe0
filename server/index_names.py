"""The indexes `espn serve` holds, by name: `--index NAME=PATH`, `--index PATH`, `--index DIR`.

Resolved here from the settings' `index` (INDEX, the default index) and `indexes` entries;
server.indexes serves each name under /v1/indexes/{name}/.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from espn.engine import DEFAULT_INDEX_NAME, RULES, ServeConfig

__all__ = ["DEFAULT_INDEX_NAME", "is_index_name", "resolve_indexes", "split_entries", "default_index_path",
           "resolve_models",
           "resolve_index_ram"]


def is_index_name(name: str) -> bool:
    """Whether `name` may name an index (the library's rule, matched whole)."""
    return RULES.index_name_problem(name) is None


def _index_dir(path: Path) -> Path:
    path = Path(path).expanduser().resolve()
    if not RULES.is_index_directory(path):
        raise ValueError(f"{path} is not an ESPN index directory (no manifest.json)")
    return path


def resolve_indexes(default: Optional[Path], entries: list[str], root: Optional[Path] = None) -> dict[str, Path]:
    """name -> index directory of every index served, the default first.

    entries: NAME=PATH, PATH (an index: the default one), or a directory of indexes (each
    subdirectory holding a manifest.json, named after it); then the indexes in `root`
    (--index-root). `default` (INDEX) is named
    `default` unless an entry names its directory. A name twice, or a bad name, is refused."""
    named: dict[str, Path] = {}

    def add(name: str, path: Path) -> None:
        problem = RULES.index_name_problem(name)
        if problem is not None:
            raise ValueError(problem)
        if name in named and named[name] != path:
            raise ValueError(f"index name {name!r} given twice ({named[name]} and {path})")
        named[name] = path

    for entry in entries:
        name, sep, rest = entry.partition("=")
        if sep and is_index_name(name):
            add(name, _index_dir(Path(rest)))
            continue
        path = Path(entry).expanduser().resolve()
        if RULES.is_index_directory(path):
            add(DEFAULT_INDEX_NAME, path)
        elif path.is_dir():
            found = ServeConfig.indexes_under(path)
            if not found:
                raise ValueError(f"{path}: neither an index (no manifest.json) nor a directory of indexes")
            for name, child in found.items():
                add(name, child)
        else:
            raise ValueError(f"--index {entry!r}: expected NAME=PATH, an index directory or a directory of indexes")
    for name, path in ServeConfig.indexes_under(root).items() if root is not None else ():
        named.setdefault(name, path)  # --index-root: its indexes, unless named otherwise already
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


def resolve_models(entries: list[str]) -> dict[str, str]:
    """name -> encoder spec of each `--model NAME=SPEC`; a bad or repeated name is refused."""
    models: dict[str, str] = {}
    for entry in entries:
        name, sep, spec = entry.partition("=")
        if not sep or not is_index_name(name) or not spec.strip():
            raise ValueError(f"--model {entry!r}: expected NAME=SPEC (an encoder as `espn index --encoder` takes it, "
                             f"e.g. minilm), NAME of {RULES.index_name_rule}")
        if name in models and models[name] != spec.strip():
            raise ValueError(f"model name {name!r} given twice")
        models[name] = spec.strip()
    return models


def resolve_index_ram(entries: list[str]) -> dict[str, float]:
    """name -> MiB of each `--index-ram NAME=MIB`; a bad name, number or repeat is refused."""
    out: dict[str, float] = {}
    for entry in entries:
        name, sep, mib = entry.partition("=")
        try:
            value = float(mib)
        except ValueError:
            value = -1.0
        if not sep or not is_index_name(name) or not 0 <= value <= float(1 << 30):
            raise ValueError(f"--index-ram {entry!r}: expected NAME=MIB, MIB a number of MiB >= 0, "
                             f"NAME of {RULES.index_name_rule}")
        if name in out and out[name] != value:
            raise ValueError(f"--index-ram names {name!r} twice")
        out[name] = value
    return out
