"""`inject_faults` is the test hook: a `FaultInjector` sees every syscall, every batch of
results and a few named points of the read path, and may fail or shorten them, as a
loaded kernel would, without any private name being patched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

__all__ = ["FaultInjector", "current_faults", "inject_faults"]


class FaultInjector:
    """Subclass and pass to `inject_faults`: the engines call it at every syscall, with every
    batch of read results, and at named points of the read path. The defaults inject nothing.

    Thread-safe subclasses only: every thread of every engine calls the one injector.
    """

    def syscall(self, name: str) -> int:
        """Before syscall `name` ("io_uring_enter", "io_submit", "io_getevents", "preadv"):
        an errno to fail it with (the call is then not made), or 0. May raise instead."""
        return 0

    def results(self, engine: str, lengths: np.ndarray, results: np.ndarray) -> np.ndarray:
        """Results of reads as the kernel reported them ([c] bytes read or -errno, for [c]
        requested lengths); return them, or changed ones (a shorter count, an -errno)."""
        return results

    def point(self, name: str) -> None:
        """At a named point of the read path ("gather": before a batch is parsed); may raise."""


_faults: FaultInjector | None = None


def current_faults() -> FaultInjector | None:
    """The injector in effect, or None (the engines' fast path checks only this)."""
    return _faults


@contextlib.contextmanager
def inject_faults(injector: FaultInjector) -> Iterator[FaultInjector]:
    """Make every engine of this process consult `injector` until the block ends."""
    global _faults
    previous, _faults = _faults, injector
    try:
        yield injector
    finally:
        _faults = previous
