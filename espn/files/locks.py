"""Who owns a file: exclusive flock locks taken within a time limit or tested without waiting,
and whether the process a lock, a slot or a directory is named after still lives."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

__all__ = ["flock_within", "lock_is_free", "process_alive"]


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
