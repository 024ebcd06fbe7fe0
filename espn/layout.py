"""Which paths an index directory may hold: the one check every copy into an index makes
before a name from outside (a generation record on object storage, a snapshot's generation
file) touches the file system.

A name is relative, written in normal form (no `.`, `..`, empty or hidden components, no
backslashes), at most a few levels deep, and of a kind the layout has (espn/generation/segments.py):
a file of the root's base (`manifest.json`, `ann.faiss`, `pool_groups.npy`,
`metadata/<field>.npy`, `text/...`) or, under `live/`, a numbered base, delta segment or side-index directory
(`base-NNNNNN/`, `seg-NNNNNN/`, `text-NNNNNN/`) or a tombstone file (`tomb-NNNNNN.npy`).
`live/`'s own control files (`CURRENT`, `LOCK`, `gen-*.json`, `PUBLISHED`) are never a
piece of a generation, so no record can overwrite them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

from .errors import IndexCorruptError
from .generation.format import LIVE_DIR, Generation

__all__ = ["check_index_path", "check_generation_layout", "inside_index"]

# One component: letters, digits, `_`, `-`, `.`; not starting with a dot (no `.`, `..`, hidden files).
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}\Z")
# What `live/` holds for a generation: numbered directories of the kinds the writer makes, tombstones.
_LIVE_DIRECTORY = re.compile(r"(?:base|seg|text)-\d{6}\Z")
_LIVE_FILE = re.compile(r"tomb-\d{6}\.npy\Z")
_MAX_DEPTH = 6


def check_index_path(path: object, what: str) -> str:
    """`path` if it names a file or directory the index layout allows, else IndexCorruptError
    naming `what` (the record or directory it came from) and the path, in one line."""

    def refuse(why: str) -> IndexCorruptError:
        return IndexCorruptError(f"{what}: refused, piece {path!r} {why}; nothing was written for it")

    if not isinstance(path, str) or not path:
        raise refuse("is not a relative path")
    if path.startswith("/") or "\\" in path or "\x00" in path:
        raise refuse("is absolute or not a plain relative path")
    parts = path.split("/")
    if len(parts) > _MAX_DEPTH:
        raise refuse(f"is more than {_MAX_DEPTH} levels deep")
    for part in parts:
        if part in ("", ".", ".."):
            raise refuse("is not in normal form (empty, '.' or '..' components) and may leave the index")
        if not _COMPONENT.match(part):
            raise refuse(f"has a component {part!r} that no index file has")
    if parts[0] == LIVE_DIR:
        if len(parts) == 1:
            raise refuse("names the live/ directory itself")
        if _LIVE_FILE.match(parts[1]):
            if len(parts) != 2:
                raise refuse("is below a tombstone file")
        elif not _LIVE_DIRECTORY.match(parts[1]):
            raise refuse("is not a base, segment, side index or tombstone under live/")
    return path


def check_generation_layout(generation: Generation, what: str) -> None:
    """Every path `generation` needs or refers to (its base, segments, tombstones and side
    indexes) passes `check_index_path`: what a copy of it would write stays inside the index."""
    for path in _generation_paths(generation):
        check_index_path(path, what)


def inside_index(root: Path, path: str, what: str) -> Path:
    """`root / path` for a path `check_index_path` allows, checked once more after symbolic
    links are resolved (a link inside the target directory must not lead out of it)."""
    target = Path(root) / check_index_path(path, what)
    resolved, top = target.parent.resolve(), Path(root).resolve()
    if resolved != top and top not in resolved.parents:
        raise IndexCorruptError(f"{what}: refused, piece {path!r} resolves to {resolved}, outside {top}")
    return target


def _generation_paths(generation: Generation) -> Iterable[str]:
    yield from (needed.path for needed in generation.needed_files())
    yield from (name for name in generation.referenced() if name != ".")
