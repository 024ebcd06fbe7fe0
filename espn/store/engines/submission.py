"""One `submit` call's extents on a kernel queue (`espn.store.engines.native`): the requests
prepared for them, what the kernel reported, retries and the first error."""

from __future__ import annotations

import errno
import os
from typing import Any, Protocol

import numpy as np

from .base import EngineRead, buffer_span, realign
from .errors import TRANSIENT_ERRNOS, ReadError, describe_fd
from .limits import IoLimits
from .ownership import LEDGER

__all__ = ["QueueBroken", "Submission", "SubmissionQueue", "MAX_EXTENT_BYTES", "WITHDRAWN", "SID_SHIFT", "INDEX_MASK"]

#: Longest extent one request may ask for: io_uring's result is an s32, and the kernel
#: caps one read at 2 GiB - 4 KiB; 1 GiB keeps every count representable.
MAX_EXTENT_BYTES = 1 << 30

#: Added to the errno of a request the kernel never took (withdrawn after the syscall kept
#: failing): such a result is final, not retried again. errnos are below 4096.
WITHDRAWN = 1 << 16

SID_SHIFT = np.uint64(32)
INDEX_MASK = np.uint64(0xFFFFFFFF)


class SubmissionQueue(Protocol):
    """What a Submission asks of the queue it belongs to (`kernel_queue.KernelQueue`)."""

    def prepare(self, fd: int, offsets: np.ndarray, addrs: np.ndarray, lengths: np.ndarray,
                user_data: np.ndarray) -> Any: ...

    def wait_for(self, sub: Submission) -> None: ...

    def cancel(self, sub: Submission) -> None: ...


class QueueBroken(OSError):
    """The kernel object stopped answering: nothing more can be submitted or reaped."""


class Submission(EngineRead):
    """One `submit` call's extents and what the kernel has reported for them.

    offsets, lengths, addrs: [m] int64; counts: [m] int64 bytes read per extent (final
    once `finished`); requests: the engine's prepared requests for the m extents.
    """

    def __init__(self, queue: SubmissionQueue, sid: int, fd: int, offsets: np.ndarray, lengths: np.ndarray,
                 addrs: np.ndarray, buffer: np.ndarray | None) -> None:
        m = len(lengths)
        self.queue = queue
        self.sid = sid
        self.fd = fd
        self.offsets = offsets
        self.lengths = lengths
        self.addrs = addrs
        self.user_data = (np.uint64(sid) << SID_SHIFT) | np.arange(m, dtype=np.uint64)
        self.requests: Any = queue.prepare(fd, offsets, addrs, lengths, self.user_data) if m else None
        self.counts = np.zeros(m, dtype=np.int64)
        self.cursor = 0  # requests [0, cursor) have been handed to the queue
        self.inflight = 0  # handed to the queue, not yet reaped
        self.retries: list[int] = []  # extents to hand over again, from counts[i] on
        self.reaped: list[tuple[np.ndarray, np.ndarray]] = []  # (user_data, res) as reaped, not yet checked
        self.attempts: np.ndarray | None = None  # [m] retries so far, made at the first retry
        self.cancelled = False
        self.finished = m == 0
        self.error: OSError | None = None
        # The ledger claim: settled once no extent can be with the kernel any more.
        self.claim: int | None = LEDGER.claim(*buffer_span(buffer)) if m and buffer is not None else None
        self.buffer = buffer  # kept alive while the kernel may write into it

    @property
    def queued(self) -> bool:
        """Some extent still waits to be handed to the kernel."""
        return self.cursor < len(self.lengths) or bool(self.retries)

    @property
    def drained(self) -> bool:
        return self.claim is None

    def wait(self) -> np.ndarray:
        if not self.finished:
            self.queue.wait_for(self)
        if self.error is not None:
            raise self.error
        return self.counts

    def cancel(self) -> None:
        if not self.finished:
            self.queue.cancel(self)

    def fail(self, i: int, err: int, detail: str = "") -> None:
        """Extent i failed for good; the first failure is the one `wait` raises."""
        if self.error is None:
            self.error = ReadError(err, describe_fd(self.fd), int(self.offsets[i]), detail)

    def finish(self, drained: bool = True) -> None:
        """No extent will be handed over again; with `drained`, none is with the kernel either."""
        self.finished = True
        self.retries = []
        self.cursor = len(self.lengths)
        if drained and self.claim is not None:
            LEDGER.settle(self.claim)
            self.claim = None
            self.buffer = None

    def settle(self, limits: IoLimits) -> None:
        """Every extent handed over is back: check the results (vectorised), queue retries."""
        if not self.reaped:
            self.finished = not self.retries
            return
        if len(self.reaped) == 1:
            user_data, res = self.reaped[0]
        else:
            user_data = np.concatenate([u for u, _ in self.reaped])
            res = np.concatenate([r for _, r in self.reaped])
        self.reaped = []
        index = (user_data & INDEX_MASK).astype(np.intp)
        res = res.astype(np.int64)
        want = self.lengths[index] - self.counts[index]
        whole = res == want
        if whole.all():  # the common case: every read returned all its bytes
            self.counts[index] += res
        else:
            self.counts[index[whole]] += res[whole]
            self._settle_odd(index[~whole], res[~whole], limits)
        self.finished = not self.retries

    def _settle_odd(self, index: np.ndarray, res: np.ndarray, limits: IoLimits) -> None:
        """Failed and short reads: retry the transient ones within the budget, fail the rest."""
        if self.attempts is None:
            self.attempts = np.zeros(len(self.lengths), dtype=np.int32)
        file_size: int | None = None
        pause = 0
        for i, got in zip(index.tolist(), res.tolist()):
            if got <= -WITHDRAWN:
                self.fail(i, -got - WITHDRAWN, f"(the kernel refused the request {limits.max_retries + 1} times)")
            elif got < 0:
                if self.cancelled:
                    self.fail(i, -got)
                elif -got in TRANSIENT_ERRNOS:
                    self.attempts[i] += 1
                    if self.attempts[i] > limits.max_retries:
                        self.fail(i, -got, f"after {limits.max_retries} retries")
                    else:
                        self.retries.append(i)
                        pause = max(pause, int(self.attempts[i]))
                else:
                    self.fail(i, -got)
            elif got > 0:
                self.counts[i] += got
                if file_size is None:
                    file_size = os.fstat(self.fd).st_size
                if self.counts[i] < self.lengths[i] and self.offsets[i] + self.counts[i] < file_size \
                        and not self.cancelled:
                    # Short, but not at the end of the file: read the rest, from the aligned
                    # block that holds it (O_DIRECT refuses an unaligned offset).
                    self.attempts[i] += 1
                    if self.attempts[i] > limits.max_retries:
                        self.fail(i, errno.EIO, f"(still short after {limits.max_retries} re-reads)")
                    else:
                        self.counts[i] = realign(int(self.counts[i]), int(self.offsets[i]), int(self.addrs[i]))
                        self.retries.append(i)
            # got == 0: the file ends here
        if pause:
            limits.pause(pause)

    def retry_requests(self, take: list[int]) -> Any:
        """Requests for the rest of extents `take` (from what they have read so far)."""
        index = np.asarray(take, dtype=np.intp)
        done = self.counts[index]
        return self.queue.prepare(self.fd, self.offsets[index] + done, self.addrs[index] + done,
                                   self.lengths[index] - done, self.user_data[index])
