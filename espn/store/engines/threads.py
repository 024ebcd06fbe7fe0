"""The portable engine: a thread pool of `os.preadv` calls.

It runs everywhere (no io_uring, no AIO), at the cost of one Python call and one GIL
round trip per extent, so it is the last resort. Each task reads an interleaved group
of extents into slices of the one buffer, so a read of m extents costs `depth` futures,
not m.

Failures follow `base.py`: transient errnos from `preadv` are retried with backoff up to
`IoLimits.max_retries` times, then fail with a `ReadError` naming the file, the offset and
the errno; a short read before the end of the file resumes from the aligned block that
holds the remainder. A read's claim on its buffer is settled once every task has ended;
`cancel` stops the tasks before their next extent; `close` waits for every task.
"""

from __future__ import annotations

import errno
import os
import threading
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from .base import EngineRead, ReadEngine, buffer_span, check_extents, realign
from .errors import TRANSIENT_ERRNOS, ReadError, StoreClosedError, describe_fd
from .faults import current_faults
from .limits import IoLimits
from .ownership import LEDGER

__all__ = ["ThreadsEngine", "read_fully"]

_DEFAULT_LIMITS = IoLimits()


def read_fully(fd: int, view: memoryview, file_offset: int, limits: IoLimits | None = None,
               cancelled: threading.Event | None = None) -> int:
    """preadv until `view` is full or the file ends; the bytes read.

    Transient errors are retried within `limits`; a short read before the end of the file
    resumes from the aligned block that holds the rest (O_DIRECT refuses an unaligned
    offset). Raises ReadError (file, offset, errno) when a read fails for good.
    """
    limits = limits or _DEFAULT_LIMITS
    got = 0
    want = len(view)
    attempts = 0
    while got < want:
        if cancelled is not None and cancelled.is_set():
            raise ReadError(errno.ECANCELED, describe_fd(fd), file_offset + got, "(cancelled)")
        faults = current_faults()
        try:
            if faults is not None:
                err = faults.syscall("preadv")
                if err:
                    raise OSError(err, os.strerror(err))
            n = os.preadv(fd, [view[got:]], file_offset + got)
            if faults is not None:
                n = int(faults.results("threads", np.array([want - got]), np.array([n]))[0])
                if n < 0:
                    raise OSError(-n, os.strerror(-n))
        except OSError as exc:
            err = exc.errno or errno.EIO
            if err in TRANSIENT_ERRNOS and attempts < limits.max_retries:
                attempts += 1
                if err != errno.EINTR:
                    limits.pause(attempts)
                continue
            detail = f"after {attempts} retries" if err in TRANSIENT_ERRNOS else ""
            raise ReadError(err, describe_fd(fd), file_offset + got, detail) from exc
        if n == 0:
            break
        got += n
        if got < want and file_offset + got < os.fstat(fd).st_size:
            attempts += 1
            if attempts > limits.max_retries:
                raise ReadError(errno.EIO, describe_fd(fd), file_offset + got,
                                f"(still short after {limits.max_retries} re-reads)")
            address = np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]
            got = realign(got, file_offset, address)
    return got


class _ThreadsRead(EngineRead):
    def __init__(self, futures: list[Future], counts: np.ndarray, cancelled: threading.Event, claim: int | None,
                 fd: int, first_offset: int, limits: IoLimits) -> None:
        self._futures = futures
        self._counts = counts
        self._cancelled = cancelled
        self._claim = claim
        self._fd = fd
        self._first_offset = first_offset
        self._limits = limits

    @property
    def drained(self) -> bool:
        if self._claim is not None and all(f.done() for f in self._futures):
            LEDGER.settle(self._claim)
            self._claim = None
        return self._claim is None

    def cancel(self) -> None:
        self._cancelled.set()
        for future in self._futures:
            future.cancel()  # the ones no thread has started

    def wait(self) -> np.ndarray:
        pending = [f for f in self._futures if not f.done()]
        while pending:
            done, not_done = wait(pending, timeout=self._limits.timeout_s, return_when=FIRST_COMPLETED)
            if not done:  # no task ended within the limit: stop the others, leave the buffer claimed
                self._cancelled.set()
                raise ReadError(errno.ETIMEDOUT, describe_fd(self._fd), self._first_offset,
                                f"(a read did not complete within {self._limits.timeout_s:g} s)")
            pending = list(not_done)
        self.drained  # noqa: B018 - settles the claim: every task has ended
        for future in self._futures:
            try:
                future.result()  # re-raises the first failure, now that every task is done
            except CancelledError:
                raise ReadError(errno.ECANCELED, describe_fd(self._fd), self._first_offset, "(cancelled)") from None
        return self._counts


class ThreadsEngine(ReadEngine):
    """`depth` threads, each reading a group of extents with `os.preadv`."""

    name = "threads"

    def __init__(self, depth: int = 16, limits: IoLimits | None = None, **options: Any) -> None:
        super().__init__(depth, limits, **options)
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="espn-io")
        self._lock = threading.Lock()
        self._closed = False
        # Reads run in the caller's thread (one group): close() waits for them as it waits for the
        # pool's, or the posix reader would close the descriptor under them and its number, reused
        # by the next open (an io_uring ring, a file), would be read instead (ESPIPE, or wrong bytes).
        self._inline = 0
        self._inline_done = threading.Condition(self._lock)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, fd: int, file_offsets: np.ndarray, lengths: np.ndarray, buffer: np.ndarray,
               buffer_offsets: np.ndarray) -> EngineRead:
        if self._closed:
            raise StoreClosedError("the threads engine is closed")
        file_offsets, lengths, buffer_offsets = check_extents(file_offsets, lengths, buffer, buffer_offsets)
        m = len(lengths)
        counts = np.zeros(m, dtype=np.int64)
        whole = buffer.data.cast("B")
        offsets, sizes, at = file_offsets.tolist(), lengths.tolist(), buffer_offsets.tolist()
        limits = self.limits
        cancelled = threading.Event()
        futures: list[Future] = []
        first = offsets[0] if m else 0
        claim = LEDGER.claim(*buffer_span(buffer), poll=lambda: all(f.done() for f in futures)) if m else None
        read = _ThreadsRead(futures, counts, cancelled, claim, fd, first, limits)

        def read_group(indices: range) -> None:
            for i in indices:
                counts[i] = read_fully(fd, whole[at[i]: at[i] + sizes[i]], offsets[i], limits, cancelled)

        groups = min(m, self.depth)
        if groups <= 1:
            future: Future = Future()
            futures.append(future)
            with self._lock:
                if self._closed:
                    future.cancel()
                    read.drained  # noqa: B018 - nothing ran: the claim is settled
                    raise StoreClosedError("the threads engine is closed")
                self._inline += 1
            try:
                read_group(range(m))
                future.set_result(None)
            except OSError as exc:
                future.set_exception(exc)
            except BaseException:
                future.cancel()
                read.drained  # noqa: B018 - nothing else runs: the claim is settled
                raise
            finally:
                with self._lock:
                    self._inline -= 1
                    if not self._inline:
                        self._inline_done.notify_all()
            return read
        try:
            with self._lock:
                if self._closed:
                    raise StoreClosedError("the threads engine is closed")
                for g in range(groups):
                    futures.append(self._pool.submit(read_group, range(g, m, groups)))
        except BaseException:
            read.cancel()  # then wait for the tasks already running: nothing may outlive a raise
            wait(futures)
            read.drained  # noqa: B018
            raise
        return read

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._inline_done.wait_for(lambda: not self._inline)  # reads in callers' threads end first
        self._pool.shutdown(wait=True)  # every task in flight ends first
