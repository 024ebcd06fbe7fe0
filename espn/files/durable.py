"""Writes that survive a crash: data written beside its target, fsynced, renamed into place,
then the directory fsynced; and removals that tolerate a file already gone.

A write is made durable this same way everywhere (the index directory, the build job, the live
writer), so a crash leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["fsync_path", "fsync_tree", "write_json_atomic", "remove_path"]


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """fsync every file under `directory`, then the directories themselves (bottom up)."""
    for path in sorted(directory.rglob("*"), key=lambda p: -len(p.parts)):
        fsync_path(path)
    fsync_path(directory)


def write_json_atomic(path: Path, obj: Any) -> None:
    """`obj` as JSON at `path`: written beside it, fsynced, renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove_path(path: Path) -> None:
    """Remove a file or a tree; gone already is fine (a staging directory's owner removes it
    itself, without the writer lock, between a listing of its parent and this call)."""
    try:  # a symbolic link is unlinked, never followed (rmtree refuses one; its target is not ours)
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    except FileNotFoundError:
        pass
