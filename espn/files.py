"""Filesystem, lock, clock and crash-point helpers shared by every writer of an index.

The lowest module of the project: it imports nothing from espn, so the index directory
(espn.index), the build job and the live writer (espn.live) can all use it. A write is
made durable the same way everywhere: data written beside its target, fsynced, renamed
into place, then the directory fsynced.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["is_index_directory", "resident_bytes", "fsync_path", "fsync_tree", "sha256_file", "file_entry", "write_json_atomic", "flock_within", "process_alive",
           "lock_is_free", "remove_path", "utc_now", "checkpoint"]


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


def sha256_file(path: Path, start: int = 0, stop: int | None = None) -> str:
    """sha256 of the file, or of its bytes [start, stop) (a live index's appended ranges)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = None if stop is None else stop - start
        while left is None or left > 0:
            block = f.read(1 << 22 if left is None else min(1 << 22, left))
            if not block:
                break
            digest.update(block)
            if left is not None:
                left -= len(block)
    return digest.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """A manifest's or generation's entry for a file: {"bytes", "sha256"}."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def write_json_atomic(path: Path, obj: Any) -> None:
    """`obj` as JSON at `path`: written beside it, fsynced, renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def flock_within(fd: int, wait_s: float, longest_pause_s: float = 0.01) -> bool:
    """Take an exclusive flock on `fd`, polling for up to `wait_s` (flock itself cannot time
    out); False when another holder kept it that long."""
    deadline = time.monotonic() + wait_s
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, longest_pause_s)


def lock_is_free(path: Path, unlink: bool = False) -> bool:
    """True when no one holds a lock on `path` (a file or a directory; the lock is taken and
    dropped at once; with `unlink`, the file is removed while the lock is held)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if unlink:
            path.unlink()
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's counts): who may still own a lock, a slot or
    a directory named after it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_path(path: Path) -> None:
    """Remove a file or a tree; gone already is fine (a staging directory's owner removes it
    itself, without the writer lock, between a listing of its parent and this call)."""
    try:  # a symbolic link is unlinked, never followed (rmtree refuses one; its target is not ours)
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    except FileNotFoundError:
        pass


def utc_now() -> str:
    """The time a generation or a base records: UTC, to the second, ISO 8601."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


#: Test hook: called with a step name at each point a crash test kills the writer
#: (tests/test_live.py and tests/crash_serve.py replace it).
_checkpoint: Callable[[str], None] = lambda step: None


def checkpoint(step: str) -> None:
    """A named crash point of a writer (live writes, compaction, replication): a no-op unless
    a test set the hook."""
    _checkpoint(step)


def is_index_directory(path: Path | str) -> bool:
    """Whether `path` holds an index (its manifest, espn.index.MANIFEST): what a directory of
    indexes is scanned for. Here, not in espn.index, so that settings can ask without numpy."""
    return (Path(path) / "manifest.json").is_file()


#: Files an open index reads from storage per query or per hit (not held in memory), and the
#: directory of the model, loaded once per process and shared between indexes.
_READ_PER_QUERY = frozenset({"embeddings.bin", "docs.jsonl"})
_SHARED_DIRS = frozenset({"encoder"})


def resident_bytes(index: Path | str, mapped_embeddings: bool = False) -> int:
    """An upper bound of what the index at `index` keeps in memory once searched: the size of every
    file its searches map (IVF, record table, ids, metadata, pooling groups, first stage, full-text
    index; each base and delta) but the records, read from storage per query unless
    `mapped_embeddings` (the mmap reader maps them), the passages, read per hit, and the model.
    Here, beside is_index_directory, so that the server can budget indexes by the library's own
    file names without loading numpy."""
    total = 0
    for top, dirs, files in os.walk(index):
        dirs[:] = [d for d in dirs if d not in _SHARED_DIRS]  # the base's, and each rewritten base's
        for name in files:
            if name in _READ_PER_QUERY and not (mapped_embeddings and name == "embeddings.bin"):
                continue
            try:
                total += os.stat(os.path.join(top, name), follow_symlinks=False).st_size
            except OSError:  # removed meanwhile (a compaction's old segment)
                continue
    return total
