"""A resource with several holders, closed by whichever releases it last (the opened base of a
live index, shared by every generation over it): lifetimes by reference count, never by a timer."""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["Shared"]


class Shared:
    """A reference count with a close action: `acquire()` for every holder, `release()` once
    by each; the last release runs `on_close` (exactly once)."""

    def __init__(self, on_close: Callable[[], None]) -> None:
        self._on_close = on_close
        self._holders = 1  # the creator holds it
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._holders == 0

    def acquire(self) -> bool:
        """Take one more hold; False when it is already closed (the caller opens its own)."""
        with self._lock:
            if self._holders == 0:
                return False
            self._holders += 1
            return True

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:
                raise RuntimeError("released more often than acquired")
            self._holders -= 1
            last = self._holders == 0
        if last:
            self._on_close()
