"""The record cache's memory: one segment per embeddings file, private to a process or shared by
every worker of a server through a file in /dev/shm, with a lock that works across processes.

Shared segments live in tmpfs (RAM, never written back to disk), named by a sharing key (one
per running server: the workers of one `espn serve` give the same key) and the identity of the
embeddings file, so the workers of a server map one copy and nothing outlives the server that
made it. Two files per segment: the data (`espn-rc-KEY-DIGEST`), on which every process that
maps it holds a shared `flock` for as long as it does, and its lock (`....lock`), held
exclusively while the segment is created and for every change of its contents (the record
cache's mutex; a thread lock in front of it orders the threads of one process).

The last process to detach removes both files; a segment whose processes all died (SIGKILL,
the OOM killer) is removed by the next process that creates one, once no one holds its data
lock. Files are created 0600 and opened without following links; one owned by another user,
or not a plain file, is never mapped (the cache is then private to the process).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import stat
import threading
from pathlib import Path
from typing import Callable, Iterator

from ..errors import InvalidParameterError

__all__ = ["CacheSegment", "open_segment", "remove_stale_segments", "segment_lock", "SHM_DIR", "SEGMENT_PREFIX",
           "check_share_key"]

logger = logging.getLogger(__name__)

#: Where shared segments live (tmpfs on Linux); absent elsewhere, then every cache is private.
SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "espn-rc-"
_LOCK_SUFFIX = ".lock"
_SHARE_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,80}$")
_OPEN_FLAGS = os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def check_share_key(key: str) -> str:
    """`key` if it can name a segment (letters, digits, `_.-`, at most 80), else InvalidParameterError."""
    if not isinstance(key, str) or not _SHARE_KEY.match(key):
        raise InvalidParameterError(f"record_cache_share must be 1-80 letters, digits or _.- characters, got {key!r}")
    return key


class CacheSegment:
    """`size` bytes of memory (`buffer`), private or shared; `created` when this process made it
    (and so initialised it). `lock()` guards changes of the contents across threads and processes."""

    def __init__(self, buffer: mmap.mmap, created: bool, path: Path | None = None,
                 data_fd: int | None = None, lock_fd: int | None = None) -> None:
        self.buffer = buffer
        self.size = len(buffer)
        self.created = created
        self.path = path
        self._data_fd, self._lock_fd = data_fd, lock_fd
        self._thread_lock = threading.Lock()
        self._pid = os.getpid()
        self.closed = False

    @property
    def shared(self) -> bool:
        return self.path is not None

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive access to the contents (every process mapping a shared segment takes it)."""
        with self._thread_lock:
            fd = self._lock_fd
            if fd is None:
                yield
                return
            if os.getpid() != self._pid:  # a forked child shares the parent's lock description
                raise RuntimeError(f"{self.path} was mapped before this process forked; open it again")
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Unmap; the last process to detach from a shared segment removes its files. Idempotent."""
        with self._thread_lock:
            if self.closed:
                return
            self.closed = True
        try:
            self.buffer.close()
        except BufferError:  # a view is still exported (a read in another thread): unmapped with it
            logger.debug("record cache segment %s still exported at close", self.path)
        if self.path is None or self._data_fd is None or self._lock_fd is None:
            return
        data_fd, lock_fd = self._data_fd, self._lock_fd
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # no one attaches while we decide
            fcntl.flock(data_fd, fcntl.LOCK_UN)
            if _try_lock(data_fd) and _same_file(data_fd, self.path):
                _unlink(self.path)
                _unlink(_lock_path(self.path))
        finally:
            os.close(data_fd)
            os.close(lock_fd)


def open_segment(size: int, share_key: str | None, identity: str,
                 initialise: Callable[[mmap.mmap], None], is_initialised: Callable[[mmap.mmap], bool],
                 directory: Path = SHM_DIR) -> CacheSegment:
    """A segment of `size` bytes: private without `share_key` (or where `directory` cannot hold
    one), else the segment of (`share_key`, `identity`) in `directory`, created here (`size`,
    `initialise` run on it) unless another process made it first (then its size is its own)."""
    if share_key is None or not directory.is_dir():
        buffer = mmap.mmap(-1, size)
        initialise(buffer)
        return CacheSegment(buffer, created=True)
    path = directory / f"{SEGMENT_PREFIX}{check_share_key(share_key)}-{identity}"
    try:
        return _open_shared(path, size, initialise, is_initialised)
    except OSError as error:
        logger.warning("cannot share the record cache through %s (%s); this process keeps its own", path, error)
        buffer = mmap.mmap(-1, size)
        initialise(buffer)
        return CacheSegment(buffer, created=True)


def _open_shared(path: Path, size: int, initialise: Callable[[mmap.mmap], None],
                 is_initialised: Callable[[mmap.mmap], bool]) -> CacheSegment:
    lock_fd = _lock_creation(_lock_path(path))
    data_fd = None
    created = False
    try:
        data_fd = _open_owned(path)
        existing = os.fstat(data_fd).st_size
        created = existing == 0
        if created:
            remove_stale_segments(path.parent, keep=path)
            _check_room(path.parent, size)
            os.ftruncate(data_fd, size)
        buffer = mmap.mmap(data_fd, size if created else existing)
        if created or not is_initialised(buffer):  # a creator that died before it finished: start over
            initialise(buffer)
            created = True
        fcntl.flock(data_fd, fcntl.LOCK_SH)  # mapped: this process counts among its users
    except BaseException:
        if data_fd is not None:
            os.close(data_fd)
        if created:  # what this process made and could not finish goes (no one else has mapped it)
            _unlink(path)
            _unlink(_lock_path(path))
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        os.close(lock_fd)
        raise
    fcntl.flock(lock_fd, fcntl.LOCK_UN)
    return CacheSegment(buffer, created, path, data_fd, lock_fd)


@contextlib.contextmanager
def segment_lock(path: Path) -> Iterator[None]:
    """The lock of the shared segment at `path`, held for the block (no one changes it meanwhile)."""
    fd = os.open(_lock_path(path), _OPEN_FLAGS)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _check_room(directory: Path, size: int) -> None:
    """OSError unless `directory` (a tmpfs) has room for `size` bytes: a page touched past a full
    tmpfs is a SIGBUS, not an error (a container's /dev/shm is 64 MiB unless it is given more)."""
    info = os.statvfs(directory)
    free = info.f_bavail * info.f_frsize
    if free < size:
        raise OSError(f"{directory} has {free / 2**20:.0f} MiB free and the cache needs {size / 2**20:.0f} MiB "
                      f"(give the container a larger /dev/shm)")


def _lock_creation(lock_path: Path) -> int:
    """The segment's lock file, opened and locked exclusively (retried when a detaching process
    removed it between our open and our lock)."""
    for _ in range(100):
        fd = _open_owned(lock_path)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _same_file(fd, lock_path):
            return fd
        os.close(fd)
    raise OSError(f"{lock_path} keeps being replaced")


def _open_owned(path: Path) -> int:
    """Open (creating 0600) a plain file of this user, never through a link."""
    fd = os.open(path, _OPEN_FLAGS | os.O_CREAT, 0o600)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(fd)
        raise OSError(f"{path} is not a private file of this user")
    return fd


def remove_stale_segments(directory: Path = SHM_DIR, keep: Path | None = None) -> list[Path]:
    """Remove the segments (and lock files) in `directory` that no process maps any more: this
    user's plain files named `espn-rc-*` whose data lock is free. Returns what went."""
    removed: list[Path] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(SEGMENT_PREFIX):
            continue
        path = directory / name
        if name.endswith(_LOCK_SUFFIX):  # a lock whose segment is gone (its creator died before making it)
            path = path.with_name(name[: -len(_LOCK_SUFFIX)])
            if name[: -len(_LOCK_SUFFIX)] in names:
                continue
        if path == keep:
            continue
        with contextlib.suppress(OSError):
            if _remove_if_unused(path):
                removed.append(path)
    return removed


def _remove_if_unused(path: Path) -> bool:
    """Remove the segment at `path` and its lock if no process maps it (or only its lock is left)."""
    lock = _lock_path(path)
    info = os.lstat(lock if not os.path.lexists(path) else path)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        return False
    lock_fd = os.open(lock, _OPEN_FLAGS | os.O_CREAT, 0o600)
    try:
        if not _try_lock(lock_fd):  # being created or detached right now
            return False
        if not os.path.lexists(path):
            _unlink(lock)
            return True
        fd = os.open(path, _OPEN_FLAGS)
        try:
            if not _try_lock(fd):
                return False
            _unlink(path)
            _unlink(_lock_path(path))
            return True
        finally:
            os.close(fd)
    finally:
        os.close(lock_fd)


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + _LOCK_SUFFIX)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
