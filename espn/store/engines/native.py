"""What the kernel-queue engines (`io_uring`, `aio`) share: submissions, the in-flight
budget, completions attributed by `user_data`, retries, errors, one queue per thread.

An engine owns one kernel queue per submitting thread (a ring, an AIO context), created
on that thread's first `submit`. A queue keeps at most `capacity` (the engine's depth)
extents in flight: a submission larger than that, or one that arrives while earlier ones
fill the queue, waits in the queue's backlog (first in, first out) and is handed to the
kernel by later `submit`s and `wait`s as slots free up. Several submissions can be in
flight on one thread at once (the searcher submits a prefetch wave, scans, submits the
next, then waits for both), so completions are attributed by `user_data`
(submission id << 32 | extent index): a `wait` for one submission keeps what it reaps
for the others.

Per extent there is no Python work. A submission's requests (SQEs, iocbs) are built once,
vectorised, when it is submitted; the queue then copies slices of them to the kernel as
slots free up. Completions are kept as the raw arrays reaped and checked once per
submission, when its last extent is back (vectorised; only a failed or short read takes
a Python loop, and a short read before the end of the file is handed back to the kernel
for the rest). Per wake-up the Python cost is a dozen numpy calls on small arrays, so a
wait returns only once a slice of the queue (`refill_fraction`) has completed.
"""

from __future__ import annotations

import abc
import errno
import os
import threading
import weakref
from collections import deque
from typing import Any

import numpy as np

from .base import EngineRead, ReadEngine, check_extents

__all__ = ["KernelQueue", "NativeEngine", "Submission", "MAX_EXTENT_BYTES"]

#: Longest extent one request may ask for: io_uring's result is an s32, and the kernel
#: caps one read at 2 GiB - 4 KiB; 1 GiB keeps every count representable.
MAX_EXTENT_BYTES = 1 << 30

_SHIFT = np.uint64(32)
_INDEX_MASK = np.uint64(0xFFFFFFFF)
_RETRY_ERRNOS = (errno.EINTR, errno.EAGAIN)

# A forked child inherits the parent's thread-local queues, but a ring or AIO context
# belongs to the process (and thread) that created it: the child makes its own.
_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Submission(EngineRead):
    """One `submit` call's extents and what the kernel has reported for them.

    offsets, lengths, addrs: [m] int64; counts: [m] int64 bytes read per extent (final
    once `finished`); requests: the engine's prepared requests for the m extents.
    """

    def __init__(self, queue: "KernelQueue", sid: int, fd: int, offsets: np.ndarray, lengths: np.ndarray,
                 addrs: np.ndarray, buffer: np.ndarray | None) -> None:
        m = len(lengths)
        self.queue = queue
        self.sid = sid
        self.fd = fd
        self.offsets = offsets
        self.lengths = lengths
        self.addrs = addrs
        self.user_data = (np.uint64(sid) << _SHIFT) | np.arange(m, dtype=np.uint64)
        self.requests: Any = queue._prepare(fd, offsets, addrs, lengths, self.user_data) if m else None
        self.counts = np.zeros(m, dtype=np.int64)
        self.cursor = 0  # requests [0, cursor) have been handed to the queue
        self.inflight = 0  # handed to the queue, not yet reaped
        self.retries: list[int] = []  # extents to hand over again, from counts[i] on
        self.reaped: list[tuple[np.ndarray, np.ndarray]] = []  # (user_data, res) as reaped, not yet checked
        self.finished = m == 0
        self.errno = 0
        self.buffer = buffer  # kept alive while the kernel may write into it

    @property
    def queued(self) -> bool:
        """Some extent still waits to be handed to the kernel."""
        return self.cursor < len(self.lengths) or bool(self.retries)

    def wait(self) -> np.ndarray:
        if not self.finished:
            self.queue.wait_for(self)
        self.buffer = None
        if self.errno:
            raise OSError(self.errno, os.strerror(self.errno))
        return self.counts

    def settle(self) -> None:
        """Every extent handed over is back: check the results (vectorised), queue retries."""
        if len(self.reaped) == 1:
            user_data, res = self.reaped[0]
        else:
            user_data = np.concatenate([u for u, _ in self.reaped])
            res = np.concatenate([r for _, r in self.reaped])
        self.reaped = []
        index = (user_data & _INDEX_MASK).astype(np.intp)
        res = res.astype(np.int64)
        want = self.lengths[index] - self.counts[index]
        whole = res == want
        if whole.all():  # the common case: every read returned all its bytes
            self.counts[index] += res
        else:
            self.counts[index[whole]] += res[whole]
            odd = ~whole
            for i, got in zip(index[odd].tolist(), res[odd].tolist()):
                if got < 0:
                    if -got in _RETRY_ERRNOS:
                        self.retries.append(i)
                    else:
                        self.errno = self.errno or -got  # the first error is the one raised
                elif got > 0:
                    self.counts[i] += got
                    if self.offsets[i] + self.counts[i] < os.fstat(self.fd).st_size:
                        self.retries.append(i)  # short, but not at the end of the file: read the rest
                # got == 0: the file ends here
        self.finished = not self.retries

    def retry_requests(self, take: list[int]) -> Any:
        """Requests for the rest of extents `take` (from what they have read so far)."""
        index = np.asarray(take, dtype=np.intp)
        done = self.counts[index]
        return self.queue._prepare(self.fd, self.offsets[index] + done, self.addrs[index] + done,
                                   self.lengths[index] - done, self.user_data[index])


class KernelQueue(abc.ABC):
    """One thread's kernel queue (an io_uring ring, an AIO context) and its bookkeeping.

    Subclasses fill four hooks: `_prepare` builds requests, `_issue` stages some of them,
    `_exchange` hands the staged ones to the kernel and reaps completions, `_release`
    frees the kernel objects. Only the creating thread may use a queue.
    """

    #: When extents still wait for a slot, a wait returns once this fraction of the queue
    #: has completed, and refills it. Each wake-up costs ~15 us of Python plus a syscall,
    #: so fewer, larger refills win even though the queue runs between half and full depth:
    #: measured at depth 32 against fio (bench_io), 0.5 gave 81% of fio's IOPS at 4.7 us
    #: CPU per read, 0.25 gave 76% at 5.4 us, 0.125 67%, 0.75 66%.
    refill_fraction = 0.5

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.owner = threading.get_ident()
        self.fork_generation = _fork_generation
        self.inflight = 0  # issued (staged or with the kernel) and not yet reaped
        self.backlog: deque[Submission] = deque()
        self.active: dict[int, Submission] = {}
        self.closed = False
        self._next_sid = 1
        self._wake = max(1, int(capacity * self.refill_fraction))

    # -- hooks ------------------------------------------------------------------------------

    @abc.abstractmethod
    def _prepare(self, fd: int, offsets: np.ndarray, addrs: np.ndarray, lengths: np.ndarray,
                 user_data: np.ndarray) -> Any:
        """Build the kernel requests for k extents ([k] int64 offsets, addresses, lengths; [k] uint64)."""

    @abc.abstractmethod
    def _issue(self, requests: Any, start: int, stop: int) -> None:
        """Stage requests[start:stop] (stop - start <= capacity - in flight)."""

    @abc.abstractmethod
    def _exchange(self, min_complete: int) -> tuple[np.ndarray, np.ndarray]:
        """Hand every staged request to the kernel, wait until at least `min_complete`
        (<= in flight) have completed, and return the completions now available:
        ([c] uint64 user_data, [c] signed bytes read or -errno)."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Free the kernel objects (ring, context) and their mappings."""

    # -- bookkeeping ------------------------------------------------------------------------

    def add(self, fd: int, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray,
            buffer: np.ndarray | None) -> Submission:
        """Queue one submission and hand the kernel as much of it as the depth allows."""
        if self.closed:
            raise ValueError("the read engine is closed")
        sid = self._next_sid
        while sid in self.active:  # 4 billion submissions later, one still unwaited
            sid = sid % 0xFFFFFFFF + 1
        self._next_sid = sid % 0xFFFFFFFF + 1
        sub = Submission(self, sid, fd, offsets, lengths, addrs, buffer)
        if sub.finished:
            return sub
        self.active[sid] = sub
        self.backlog.append(sub)
        self._fill()
        user_data, res = self._exchange(0)
        if len(user_data):
            self._complete(user_data, res)
        return sub

    def wait_for(self, sub: Submission) -> None:
        """Drive the queue until `sub` has finished (others progress on the way)."""
        if threading.get_ident() != self.owner:
            raise RuntimeError("wait() must run on the thread that submitted (one kernel queue per thread)")
        if self.closed:
            raise ValueError("the read engine is closed")
        while not sub.finished:
            self._fill()
            if sub.queued:
                # Extents still wait for a slot: wake when a slice of the queue can be refilled.
                min_complete = min(self.inflight, self._wake)
            else:
                # All of sub is with the kernel: at least sub.inflight completions must arrive.
                min_complete = sub.inflight
            assert 0 < min_complete <= self.inflight, (min_complete, self.inflight)
            user_data, res = self._exchange(min_complete)
            if len(user_data):
                self._complete(user_data, res)

    def _fill(self) -> None:
        """Stage retries and backlog extents, oldest submission first, while slots are free."""
        free = self.capacity - self.inflight
        while free > 0 and self.backlog:
            sub = self.backlog[0]
            if sub.retries:
                take, sub.retries = sub.retries[:free], sub.retries[free:]
                k = len(take)
                self._issue(sub.retry_requests(take), 0, k)
            elif sub.cursor < len(sub.lengths):
                start = sub.cursor
                k = min(free, len(sub.lengths) - start)
                self._issue(sub.requests, start, start + k)
                sub.cursor = start + k
            else:
                self.backlog.popleft()
                continue
            sub.inflight += k
            self.inflight += k
            free -= k

    def _complete(self, user_data: np.ndarray, res: np.ndarray) -> None:
        """Hand reaped completions to their submissions; settle those that are all back."""
        self.inflight -= len(user_data)
        if len(self.active) == 1:
            groups: list[tuple[Submission, np.ndarray, np.ndarray]] = [
                (next(iter(self.active.values())), user_data, res)]
        else:
            sids = user_data >> _SHIFT
            groups = []
            for sid in np.unique(sids).tolist():
                sel = sids == sid
                groups.append((self.active[sid], user_data[sel], res[sel]))
        for sub, ud, r in groups:
            sub.reaped.append((ud, r))
            sub.inflight -= len(ud)
            if sub.inflight or sub.queued:
                continue
            sub.settle()
            if sub.finished:
                del self.active[sub.sid]
            elif sub not in self.backlog:  # retries: back in line (the backlog holds a few at most)
                self.backlog.append(sub)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._release()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to report to
            pass


class NativeEngine(ReadEngine):
    """A ReadEngine over per-thread `KernelQueue`s; subclasses say how to make one.

    `wait()` must run on the thread that called `submit` (the queue belongs to it).
    `close()` releases every thread's queue; call it once no read is in flight.
    """

    def __init__(self, depth: int = 64, **options: Any) -> None:
        super().__init__(depth, **options)
        self._local = threading.local()
        self._queues: weakref.WeakSet[KernelQueue] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False

    @abc.abstractmethod
    def _new_queue(self) -> KernelQueue:
        """A queue for the calling thread, of capacity `self.depth`."""

    def _queue(self) -> KernelQueue:
        queue: KernelQueue | None = getattr(self._local, "queue", None)
        if queue is None or queue.fork_generation != _fork_generation:
            with self._lock:
                if self._closed:
                    raise ValueError(f"the {self.name} engine is closed")
                queue = self._new_queue()
                self._queues.add(queue)
            self._local.queue = queue
        return queue

    def submit(self, fd: int, file_offsets: np.ndarray, lengths: np.ndarray, buffer: np.ndarray,
               buffer_offsets: np.ndarray) -> EngineRead:
        file_offsets, lengths, buffer_offsets = check_extents(file_offsets, lengths, buffer, buffer_offsets)
        if len(lengths) and int(lengths.max()) > MAX_EXTENT_BYTES:
            raise ValueError(f"an extent is longer than {MAX_EXTENT_BYTES} bytes")
        addrs = buffer_offsets + buffer.__array_interface__["data"][0]
        return self._queue().add(fd, file_offsets, lengths, addrs, buffer)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            queues = list(self._queues)
            self._queues = weakref.WeakSet()
        for queue in queues:
            queue.close()


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
        queue.close()
    return None
