"""The directory where the workers of `espn serve --workers N` write their metric samples.

prometheus_client's multiprocess mode needs one directory shared by the workers
(PROMETHEUS_MULTIPROC_DIR). `espn serve` makes it in the temporary directory and removes it
when it stops; a server killed with SIGKILL (or by the OOM killer) cannot, so the next start
removes what dead servers left. Only directories that are certainly stale go: named
`espn-metrics-<pid>-*` by this module, owned by this user, a real directory (not a link),
whose owner's lock (an `flock` on the directory, held by the serving process for its life)
is free and whose pid is no longer running. The lock alone would do on one machine; the pid
also keeps a directory whose owner has only just made it (and not yet locked it), and the
lock keeps one whose owner runs in another pid namespace (a container sharing /tmp).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from espn.engine import startup

__all__ = ["MetricsDir", "PREFIX", "remove_stale", "record_cache_share"]

PREFIX = "espn-metrics-"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-[A-Za-z0-9_]+$")


def remove_stale(parent: Path | None = None) -> list[Path]:
    """Remove the metric directories of `espn serve` processes that are gone (see the module's
    docstring) from `parent` (default: the temporary directory); returns what went."""
    parent = Path(parent if parent is not None else tempfile.gettempdir())
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    for name in names:
        match = _NAME.match(name)
        if match is None or int(match[1]) == os.getpid():
            continue
        path = parent / name
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            continue
        if startup().process_alive(int(match[1])) or not startup().lock_is_free(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class MetricsDir:
    """A fresh `espn-metrics-<pid>-*` directory, locked by this process until `close()` removes it."""

    def __init__(self, parent: Path | None = None) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-",
                                          dir=None if parent is None else str(parent)))
        # O_CLOEXEC: a spawned worker does not inherit the lock; a forked one (--preload) does,
        # and while it lives the directory is in use anyway.
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def close(self) -> None:
        if self._fd >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._fd)
            self._fd = -1


def record_cache_share() -> str | None:
    """The key under which the workers of this `espn serve` share one record cache: the name of
    their metrics directory (one per server start, so a restarted server never maps what an
    earlier one left); None without one (a single worker keeps its cache to itself)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    return Path(path).name if path else None
