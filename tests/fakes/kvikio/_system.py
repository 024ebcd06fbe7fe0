"""The fake's process-wide state: settings, the thread pool, and test controls."""

from __future__ import annotations

import concurrent.futures
import enum
import threading
from typing import Any, Callable


class CompatMode(enum.IntEnum):
    """kvikio._lib.defaults.CompatMode (values as in the real enum)."""

    OFF = 0
    ON = 1
    AUTO = 2


class FakeSystem:
    """Settings as kvikio 26.10 starts without KVIKIO_* variables, a pool, and a trace."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.settings: dict[str, Any] = {}
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.reset()

    def reset(self) -> None:
        if self.pool is not None:
            self.release.set()
            self.pool.shutdown(wait=True)
        self.settings = {
            "compat_mode": CompatMode.AUTO,
            "num_threads": 1,
            "task_size": 4 << 20,
            "gds_threshold": 16 << 10,
            "bounce_buffer_size": 16 << 20,
        }
        #: What AUTO resolves to: True = no cuFile here (the POSIX path), as on this machine.
        self.gds_unavailable = True
        #: Every call, in order: ("pread", file_offset, size, thread name), ("task", ...),
        #: ("shortcut", ...), ("get", file_offset).
        self.trace: list[tuple[Any, ...]] = []
        #: Tasks wait on this before reading: clear it to hold reads in flight.
        self.release = threading.Event()
        self.release.set()
        #: file_offset -> exception raised by the task that reads there.
        self.fail: dict[int, BaseException] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self.set_calls: list[dict[str, Any]] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-kvikio")

    def set_threads(self, n: int) -> None:
        # kvikio: waits for running tasks, then rebuilds the pool with n threads.
        old = self.pool
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="fake-kvikio")
        if old is not None:
            old.shutdown(wait=True)

    def submit(self, fn: Callable[[], int]) -> concurrent.futures.Future[int]:
        assert self.pool is not None
        return self.pool.submit(fn)

    def log(self, *event: Any) -> None:
        with self.lock:
            self.trace.append(event)


_fake = FakeSystem()
