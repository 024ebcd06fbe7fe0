"""Staging directories, crash recovery and garbage collection of a live index's `live/` directory.

Everything here runs under the writer lock, except the work inside a `Staging` directory
(an `espn add`'s encoding, a compaction), which its owner's flock protects instead.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import ContextManager, Iterator, Protocol

from espn.files.durable import fsync_path, remove_path
from espn.files.locks import flock_within, lock_is_free
from espn.index import FILES, OPTIONAL_FILES
from espn.metadata import DIRECTORY as METADATA_DIR
from espn.generation.format import LIVE_DIR, Generation, read_current, read_generation

from .progress import is_running_progress

__all__ = ["Staging", "recover", "remove_write_leftovers", "collect_garbage", "NUMBERED", "LOCK_FILE"]

log = logging.getLogger(__name__)

#: Names of the numbered files and directories of live/: gen-000012.json, seg-000012, text-000012...
NUMBERED = re.compile(r"^([a-z]+)-(\d{6})(?:\.[a-z]+)?$")
#: The writer lock of an index, in live/ (espn.live.writer takes it for each publish).
LOCK_FILE = "LOCK"


class _Lockable(Protocol):
    """What a Staging needs of the writer: its live/ directory and its lock."""

    @property
    def live_dir(self) -> Path: ...

    def locked(self, wait_s: float = 0.0) -> ContextManager[object]: ...


class _HeldLock:
    """The writer lock as its holder sees it: held already (Staging.under_lock)."""

    def __init__(self, live_dir: Path) -> None:
        self.live_dir = live_dir

    @contextlib.contextmanager
    def locked(self, wait_s: float = 0.0) -> Iterator[None]:
        yield


class Staging:
    """A work directory under live/ that survives the writers' crash recovery while its owner
    lives: the owner holds an `flock` on it, and `recover` removes a staging directory only
    when it can take that lock (its owner died). For `espn add`'s encoding and compaction,
    which run without the writer lock; it is made under that lock (briefly), so that no
    recovery sees it before it is locked."""

    PREFIXES = ("stage-",)

    def __init__(self, writer: _Lockable, kind: str, wait_s: float) -> None:
        with writer.locked(wait_s):
            self._make(writer.live_dir, kind)

    @classmethod
    def under_lock(cls, live_dir: Path, kind: str) -> "Staging":
        """For a caller that holds the writer lock already (a side index, in a publish)."""
        return cls(_HeldLock(live_dir), kind, 0.0)

    def _make(self, live_dir: Path, kind: str) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"stage-{kind}-", dir=live_dir))
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._fd)
            self._fd = -1


def recover(root: Path) -> list[str]:
    """Undo what a crashed or failed writer left unpublished (under the writer lock): staging
    directories, files of unpublished generations, and records appended past the
    published end of embeddings.bin. Staging of a live compaction or `espn add` is kept, and so
    is the progress file a running compaction is replacing (it works without the writer lock).
    Returns what went (paths under the index)."""
    current = read_current(root)
    live_dir = root / LIVE_DIR
    removed = []
    for path in live_dir.iterdir():
        name = path.name
        match = NUMBERED.match(name)
        if (name.endswith(".tmp") and not is_running_progress(path)) or name == "incoming" \
                or (match is not None and int(match[2]) > current.number) \
                or (name.startswith(Staging.PREFIXES) and lock_is_free(path)):
            remove_path(path)
            removed.append(f"{LIVE_DIR}/{name}")
    embeddings = root / current.base / "embeddings.bin"
    if embeddings.stat().st_size > current.embeddings_bytes:
        with open(embeddings, "r+b") as f:
            f.truncate(current.embeddings_bytes)
            os.fsync(f.fileno())
        removed.append(f"{(Path(current.base) / 'embeddings.bin').as_posix()} past byte {current.embeddings_bytes}")
    return removed + collect_garbage(root)


def remove_write_leftovers(root: Path) -> list[str]:
    """What stopped writers left in the index at `root` (`recover`: a staging directory whose owner
    is gone, files of a generation never published, records past the published end), removed now
    when no writer holds the lock (else that writer's own recovery removes it); what went. For a
    server opening an index to write, whether or not it warms up. An index never written to (no
    live/ directory) and one on a read-only filesystem are left as they are."""
    live_dir = Path(root) / LIVE_DIR
    if not live_dir.is_dir():
        return []
    try:
        fd = os.open(live_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return []
        raise
    try:
        return recover(Path(root)) if flock_within(fd, 0.0) else []
    finally:
        os.close(fd)  # drops the lock


def collect_garbage(root: Path) -> list[str]:
    """Remove the files of generations no reader holds (their shared lock); returns what went.
    Under the writer lock."""
    current = read_current(root)
    live_dir = root / LIVE_DIR
    kept = _held_generations(live_dir, current)
    if kept is None:
        return []
    referenced = set().union(*(g.referenced() for g in kept))
    root_in_use = "." in referenced or not lock_is_free(root / "manifest.json")
    removed = []
    for path in live_dir.iterdir():
        match = NUMBERED.match(path.name)
        if match is None or match[1] == "gen" or int(match[2]) > current.number:
            continue
        if f"{LIVE_DIR}/{path.name}" not in referenced:
            remove_path(path)
            removed.append(f"{LIVE_DIR}/{path.name}")
    if not root_in_use:
        removed += _remove_first_base(root)
    if removed:
        fsync_path(live_dir)
        log.info("removed %s", ", ".join(removed))
    return removed


def _held_generations(live_dir: Path, current: Generation) -> list[Generation] | None:
    """The current generation and the older ones a reader holds (the others' records are
    unlinked); None when one cannot be read (keep every file until it goes)."""
    kept: list[Generation] = [current]
    for path in sorted(live_dir.glob("gen-*.json")):
        match = NUMBERED.match(path.name)
        if match is None or int(match[2]) >= current.number:
            continue
        # Unlinked under the exclusive lock, so a reader locking it afterwards finds it gone
        # and opens the current one instead.
        if not lock_is_free(path, unlink=True):
            try:
                kept.append(read_generation(path))
            except Exception:  # noqa: BLE001 - unreadable: keep what it may need, collect it later
                log.warning("cannot read %s; keeping every file until it goes", path)
                return None
    return kept


def _remove_first_base(root: Path) -> list[str]:
    """The root's own index files, once no generation or reader needs the first base."""
    removed = []
    for file in (*FILES, *OPTIONAL_FILES):
        if (root / file).exists():
            (root / file).unlink()
            removed.append(file)
    if (root / METADATA_DIR).is_dir():  # the first base's columns
        shutil.rmtree(root / METADATA_DIR)
        removed.append(METADATA_DIR)
    return removed

