"""What the kernel-queue engines (`io_uring`, `aio`) share: submissions, the in-flight
budget, completions attributed by `user_data`, retries, errors, one queue per thread, and
the lifetime of each queue.

An engine owns one kernel queue per submitting thread (a ring, an AIO context), created
on that thread's first `submit`. A queue keeps at most `capacity` (the engine's depth)
extents in flight: a submission larger than that, or one that arrives while earlier ones
fill the queue, waits in the queue's backlog (first in, first out) and is handed to the
kernel by later `submit`s and `wait`s as slots free up. Several submissions can be in
flight on one thread at once (the searcher submits a prefetch wave, scans, submits the
next, then waits for both), so completions are attributed by `user_data`
(submission id << 32 | extent index): a `wait` for one submission keeps what it reaps
for the others. Submission id 0 is the queue's own (cancel requests).

Per extent there is no Python work. A submission's requests (SQEs, iocbs) are built once,
vectorised, when it is submitted; the queue then copies slices of them to the kernel as
slots free up. Completions are kept as the raw arrays reaped and checked once per
submission, when its last extent is back (vectorised; only a failed or short read takes
a Python loop). Per wake-up the Python cost is a dozen numpy calls on small arrays, so a
wait returns only once a slice of the queue (`refill_fraction`) has completed.

Failures (the ownership rule of `base.py` applied to a queue):
- a transient errno from the syscalls is retried by the subclass's `_exchange`, with
  backoff, after reaping; after `IoLimits.max_retries` the requests the kernel never took
  are withdrawn and fail with that errno (`_withdrawn`), so nothing is left staged;
- a transient result of one read (-EAGAIN, -EINTR...) is handed back to the kernel after a
  pause, at most `max_retries` times; a short read before the end of the file re-reads
  from the aligned block that holds the remainder (`base.realign`);
- a wait that sees no completion for `IoLimits.timeout_s` cancels what is in flight
  (`_cancel_in_flight`), reaps it, and fails with ETIMEDOUT; a queue whose kernel object
  stops answering altogether is *broken*: its submissions finish with the error but keep
  their ledger claims (their buffers stay quarantined) and the thread gets a new queue;
- an exception between the syscalls (KeyboardInterrupt, MemoryError) in `add` withdraws
  the submission and drains what the kernel took before it propagates.

Closing: a queue is released by its own thread once it has drained, or by the closing
thread after the owner has drained it (`shut`); a closing queue refuses new submissions.
"""

from __future__ import annotations

import abc
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .base import EngineRead, ReadEngine, check_extents
from .errors import StoreClosedError
from .limits import IoLimits
from .kernel_queue import KernelQueue, fork_generation
from .submission import MAX_EXTENT_BYTES

__all__ = ["NativeEngine", "probe_read"]


class NativeEngine(ReadEngine):
    """A ReadEngine over per-thread `KernelQueue`s; subclasses say how to make one.

    `wait()` must run on the thread that called `submit` (the queue belongs to it).
    `close()` lets every thread's reads drain first (see `KernelQueue.shut`).
    """

    def __init__(self, depth: int = 64, limits: IoLimits | None = None, **options: Any) -> None:
        super().__init__(depth, limits, **options)
        self._local = threading.local()
        self._queues: weakref.WeakSet[KernelQueue] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False
        self._idle_callbacks: list[Callable[[], None]] = []

    @abc.abstractmethod
    def _new_queue(self) -> KernelQueue:
        """A queue for the calling thread, of capacity `self.depth`."""

    @property
    def closed(self) -> bool:
        return self._closed

    def _queue(self) -> KernelQueue:
        queue: KernelQueue | None = getattr(self._local, "queue", None)
        if queue is None or queue.fork_generation != fork_generation() or queue.broken is not None:
            with self._lock:
                if self._closed:
                    raise StoreClosedError(f"the {self.name} engine is closed")
                queue = self._new_queue()
                queue.on_release = weakref.WeakMethod(self._queue_released)
                self._queues.add(queue)
            self._local.queue = queue
        return queue

    def submit(self, fd: int, file_offsets: np.ndarray, lengths: np.ndarray, buffer: np.ndarray,
               buffer_offsets: np.ndarray) -> EngineRead:
        if self._closed:
            raise StoreClosedError(f"the {self.name} engine is closed")
        file_offsets, lengths, buffer_offsets = check_extents(file_offsets, lengths, buffer, buffer_offsets)
        if len(lengths) and int(lengths.max()) > MAX_EXTENT_BYTES:
            raise ValueError(f"an extent is longer than {MAX_EXTENT_BYTES} bytes")
        addrs = buffer_offsets + buffer.__array_interface__["data"][0]
        return self._queue().add(fd, file_offsets, lengths, addrs, buffer)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            queues = list(self._queues)
        for queue in queues:
            queue.shut()
        self._run_idle_callbacks()

    def when_idle(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._idle_callbacks.append(callback)
        self._run_idle_callbacks()

    def _queue_released(self) -> None:
        self._run_idle_callbacks()

    def _run_idle_callbacks(self) -> None:
        with self._lock:
            if not self._closed or any(not q.released for q in self._queues):
                return
            callbacks, self._idle_callbacks = self._idle_callbacks, []
        for callback in callbacks:
            callback()


def probe_read(queue: "KernelQueue", label: str) -> str | None:
    """One real 4-byte read through `queue` from a memfd, so every part an engine uses is known
    to work before it is chosen; the reason it failed, or None. Closes the queue."""
    src = os.memfd_create(f"espn-{label}-probe", getattr(os, "MFD_CLOEXEC", 0))
    try:
        os.write(src, b"espn")
        out = np.zeros(8, dtype=np.uint8)
        offsets, lengths = np.zeros(1, dtype=np.int64), np.full(1, 4, dtype=np.int64)
        counts = queue.add(src, offsets, lengths, offsets + out.ctypes.data, out).wait()
        if int(counts[0]) != 4 or out[:4].tobytes() != b"espn":
            return f"{label} test read returned {counts.tolist()} bytes: {out[:4].tobytes()!r}"
    except OSError as exc:
        return f"{label} test read failed: {exc}"
    finally:
        os.close(src)
        queue.shut()
    return None
