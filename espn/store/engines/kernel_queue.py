"""One thread's kernel queue (an io_uring ring, an AIO context): the in-flight budget, the
backlog, completions attributed by `user_data`, timeouts, breaking and release. The module
doc of `espn.store.engines.native` describes the whole."""

from __future__ import annotations

import abc
import errno
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import ReadError, StoreClosedError, describe_fd
from .faults import current_faults
from .limits import IoLimits
from .submission import INDEX_MASK, SID_SHIFT, QueueBroken, Submission

__all__ = ["KernelQueue", "fork_generation"]

logger = logging.getLogger(__name__)

# A forked child inherits the parent's thread-local queues, but a ring or AIO context
# belongs to the process (and thread) that created it: the child makes its own.
_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def fork_generation() -> int:
    """How many forks this process is from the one that started (a queue made before a fork
    belongs to the parent)."""
    return _fork_generation


class KernelQueue(abc.ABC):
    """One thread's kernel queue (an io_uring ring, an AIO context) and its bookkeeping.

    Subclasses fill five hooks: `_prepare` builds requests, `_issue` stages some of them,
    `_exchange` hands the staged ones to the kernel and reaps completions,
    `_cancel_in_flight` asks the kernel to cancel what it has, `_release` frees the kernel
    objects. Only the creating thread may submit to or reap from a queue.
    """

    #: When extents still wait for a slot, a wait returns once this fraction of the queue
    #: has completed, and refills it. Each wake-up costs ~15 us of Python plus a syscall,
    #: so fewer, larger refills win even though the queue runs between half and full depth:
    #: measured at depth 32 against fio (bench_io), 0.5 gave 81% of fio's IOPS at 4.7 us
    #: CPU per read, 0.25 gave 76% at 5.4 us, 0.125 67%, 0.75 66%.
    refill_fraction = 0.5
    #: The engine's name, for fault injection and messages.
    engine_name = "native"

    def __init__(self, capacity: int, limits: IoLimits | None = None) -> None:
        self.capacity = capacity
        self.limits = limits or IoLimits()
        self.owner = threading.get_ident()
        self.fork_generation = fork_generation()
        self.inflight = 0  # issued (staged or with the kernel) and not yet reaped
        self.backlog: deque[Submission] = deque()
        self.active: dict[int, Submission] = {}
        self.closing = False  # refuses new submissions; released once drained
        self.released = False
        self.broken: OSError | None = None
        self._busy = 0  # add / wait_for calls of the owner in progress
        self.on_release: weakref.WeakMethod | None = None  # the engine's, told when this queue is released
        self._state = threading.Condition(threading.Lock())
        self._internal = 0  # the queue's own requests with the kernel (sid 0: cancels)
        self._next_sid = 1
        self._wake = max(1, int(capacity * self.refill_fraction))

    @property
    def closed(self) -> bool:
        return self.released

    # -- hooks ------------------------------------------------------------------------------

    @abc.abstractmethod
    def _prepare(self, fd: int, offsets: np.ndarray, addrs: np.ndarray, lengths: np.ndarray,
                 user_data: np.ndarray) -> Any:
        """Build the kernel requests for k extents ([k] int64 offsets, addresses, lengths; [k] uint64)."""

    def prepare(self, fd: int, offsets: np.ndarray, addrs: np.ndarray, lengths: np.ndarray,
                user_data: np.ndarray) -> Any:
        """Requests for these extents (what a Submission hands over, and again for retries)."""
        return self._prepare(fd, offsets, addrs, lengths, user_data)

    @abc.abstractmethod
    def _issue(self, requests: Any, start: int, stop: int) -> None:
        """Stage requests[start:stop] (stop - start <= capacity - in flight)."""

    @abc.abstractmethod
    def _exchange(self, min_complete: int, timeout: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Hand every staged request to the kernel, wait until at least `min_complete`
        (<= in flight) have completed or `timeout` seconds have passed, and return the
        completions now available: ([c] uint64 user_data, [c] signed bytes read or -errno).

        Transient syscall errors are retried within `limits`; requests the kernel never
        took are then returned as completions with -(errno + WITHDRAWN). Raises
        QueueBroken when nothing more can be reaped.
        """

    @abc.abstractmethod
    def _cancel_in_flight(self) -> bool:
        """Ask the kernel to cancel every request it holds (their completions follow);
        False when it cannot."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Free the kernel objects (ring, context) and their mappings."""

    # -- the owner's operations -----------------------------------------------------------

    def _begin(self, submitting: bool) -> None:
        with self._state:
            if self.released or (submitting and self.closing):
                raise StoreClosedError(f"the {self.engine_name} engine is closed")
            self._busy += 1

    def _end(self) -> None:
        with self._state:
            self._busy -= 1
            if self.closing and not self._busy:
                if not self.active and not self.released:
                    self._release_now()  # drained, on its own thread
                self._state.notify_all()

    def add(self, fd: int, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray,
            buffer: np.ndarray | None) -> Submission:
        """Queue one submission and hand the kernel as much of it as the depth allows."""
        self._begin(submitting=True)
        try:
            sid = self._next_sid
            while sid in self.active:  # 4 billion submissions later, one still unwaited
                sid = sid % 0xFFFFFFFF + 1
            self._next_sid = sid % 0xFFFFFFFF + 1
            sub = Submission(self, sid, fd, offsets, lengths, addrs, buffer)
            try:
                if sub.finished:
                    return sub
                self.active[sid] = sub
                self.backlog.append(sub)
                self._fill()
                user_data, res = self._exchange(0)
                if len(user_data):
                    self._complete(user_data, res)
            except QueueBroken as exc:
                self._break(exc)  # sub carries the error; its wait raises it
            except BaseException:
                self._abandon(sub)  # nothing in flight may outlive a submit that raised
                raise
            return sub
        finally:
            self._end()

    def wait_for(self, sub: Submission) -> None:
        """Drive the queue until `sub` has finished (others progress on the way)."""
        if threading.get_ident() != self.owner:
            raise RuntimeError("wait() must run on the thread that submitted (one kernel queue per thread)")
        self._begin(submitting=False)
        try:
            self._drive(lambda: sub.finished, sub)
        finally:
            self._end()

    def cancel(self, sub: Submission) -> None:
        """Withdraw what `sub` has not handed to the kernel yet; the rest is reaped later.
        Only the owner thread touches the queue: elsewhere this does nothing."""
        if sub.finished or threading.get_ident() != self.owner:
            return
        sub.cancelled = True
        for i in list(range(sub.cursor, len(sub.lengths))) + sub.retries:
            sub.fail(i, errno.ECANCELED, "(cancelled before it was submitted)")
        sub.cursor = len(sub.lengths)
        sub.retries = []
        try:
            self.backlog.remove(sub)
        except ValueError:
            pass
        if not sub.inflight:
            sub.settle(self.limits)
            self._finished(sub)

    def _abandon(self, sub: Submission) -> None:
        """After an exception in `add`: withdraw `sub` and drain what the kernel took, even
        through further KeyboardInterrupts; failures here leave it claimed (quarantined)."""
        interrupted = 0
        while not sub.finished and interrupted < 100:
            try:
                self.cancel(sub)
                if not sub.finished:
                    self._drive(lambda: sub.finished, sub)
            except KeyboardInterrupt:
                interrupted += 1
            except QueueBroken as exc:
                self._break(exc)
            except Exception:  # noqa: BLE001 - the original exception is the one to report
                logger.warning("could not drain a read abandoned by an exception", exc_info=True)
                return

    def _drive(self, done: Callable[[], bool], target: Submission | None) -> None:
        """Exchange with the kernel until `done()`; the stall limit is a real code path."""
        idle_since: float | None = None
        timeout = self.limits.timeout_s
        try:
            while not done():
                self._fill()
                if self.inflight <= 0:
                    raise RuntimeError(f"{self.engine_name} queue bookkeeping: a read is unfinished "
                                       "with nothing in flight")
                if target is None:
                    min_complete = self.inflight
                elif target.queued:
                    # Extents still wait for a slot: wake when a slice of the queue can be refilled.
                    min_complete = min(self.inflight, self._wake)
                else:
                    # All of target is with the kernel: at least target.inflight completions must arrive.
                    min_complete = max(1, min(target.inflight, self.inflight))
                left = timeout if idle_since is None else timeout - (time.monotonic() - idle_since)
                user_data, res = self._exchange(min_complete, max(left, 1e-3))
                if len(user_data):
                    self._complete(user_data, res)
                    idle_since = None
                    continue
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                elif now - idle_since >= timeout:
                    self._stalled()
                    idle_since = None
        except QueueBroken as exc:
            self._break(exc)

    def _stalled(self) -> None:
        """No completion for `timeout_s`: fail what is in flight with ETIMEDOUT, cancel it,
        and reap it within another `timeout_s`; a kernel that does not give it back breaks
        the queue."""
        timeout = self.limits.timeout_s
        for sub in list(self.active.values()):
            if sub.inflight and sub.error is None:
                sub.error = ReadError(errno.ETIMEDOUT, describe_fd(sub.fd), int(sub.offsets[0]),
                                      f"(a read of this batch did not complete within {timeout:g} s)")
            self.cancel(sub)
        if not self._cancel_in_flight():
            raise QueueBroken(errno.ETIMEDOUT, f"reads did not complete within {timeout:g} s and cannot be cancelled")
        deadline = time.monotonic() + timeout
        while self.inflight > 0 and time.monotonic() < deadline:
            user_data, res = self._exchange(min(self.inflight, 1), deadline - time.monotonic())
            if len(user_data):
                self._complete(user_data, res)
        if self.inflight > 0:
            raise QueueBroken(errno.ETIMEDOUT, f"cancelled reads were not given back within {timeout:g} s")

    def _break(self, exc: OSError) -> None:
        """The kernel object stopped answering: every submission finishes with the error but
        keeps its claim (its buffer stays quarantined); the thread gets a new queue."""
        self.broken = exc
        for sub in list(self.active.values()):
            if sub.error is None:
                sub.error = ReadError(exc.errno or errno.EIO, describe_fd(sub.fd), int(sub.offsets[0]),
                                      f"({self.engine_name} queue broken: {exc.strerror})")
            sub.finish(drained=False)
        self.active.clear()
        self.backlog.clear()
        logger.error("%s queue broken (%s): reads still in flight keep their buffers quarantined",
                     self.engine_name, exc)

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
        if self._internal:  # the queue's own requests (cancels) were never counted in flight
            keep = (user_data >> SID_SHIFT) != 0
            self._internal -= int(len(keep) - np.count_nonzero(keep))
            user_data, res = user_data[keep], res[keep]
        self.inflight -= len(user_data)
        if len(self.active) == 1:
            groups: list[tuple[Submission, np.ndarray, np.ndarray]] = [
                (next(iter(self.active.values())), user_data, res)]
        else:
            sids = user_data >> SID_SHIFT
            groups = []
            for sid in np.unique(sids).tolist():
                sel = sids == sid
                groups.append((self.active[sid], user_data[sel], res[sel]))
        faults = current_faults()
        for sub, ud, r in groups:
            if faults is not None:
                index = (ud & INDEX_MASK).astype(np.intp)
                r = np.asarray(faults.results(self.engine_name, sub.lengths[index] - sub.counts[index], r.copy()))
            sub.reaped.append((ud, r))
            sub.inflight -= len(ud)
            if sub.inflight or sub.queued:
                continue
            sub.settle(self.limits)
            if sub.finished:
                self._finished(sub)
            elif sub not in self.backlog:  # retries: back in line (the backlog holds a few at most)
                self.backlog.append(sub)

    def _finished(self, sub: Submission) -> None:
        self.active.pop(sub.sid, None)
        sub.finish()

    # -- closing ----------------------------------------------------------------------------

    def shut(self) -> bool:
        """Close: refuse new submissions, let every read in flight drain, release. On the owner
        thread the queue is drained here (backlog cancelled, the rest reaped); from another
        thread, this waits up to `timeout_s` for the owner to drain it, and the owner releases
        it itself if that takes longer. True when released."""
        with self._state:
            if self.released:
                return True
            self.closing = True
        if self.fork_generation != fork_generation():
            # Inherited from the parent: its reads write into the parent's pages, not ours.
            with self._state:
                self._release_now()
            return True
        if threading.get_ident() == self.owner:
            if self._busy:  # called from inside add/wait (a fault hook): the owner releases it at the end
                return False
            self._begin(submitting=False)
            try:
                for sub in list(self.active.values()):
                    self.cancel(sub)
                self._drive(lambda: not self.active, None)
            except QueueBroken as exc:
                self._break(exc)
            finally:
                self._end()  # releases it: drained, on its own thread
            return self.released
        with self._state:
            drained = self._state.wait_for(lambda: self.released or (not self._busy and not self.active),
                                           self.limits.timeout_s)
            if drained and not self.released:
                self._release_now()
            if not self.released:
                logger.warning("a %s queue of thread %d still has %d read(s) in flight after %g s; its thread "
                               "releases it once they drain, their buffers stay quarantined until then",
                               self.engine_name, self.owner, sum(s.inflight for s in self.active.values()),
                               self.limits.timeout_s)
            return self.released

    def close(self) -> None:
        self.shut()

    def _release_now(self) -> None:
        """Under `_state`: nothing is in flight (or the queue is broken, or inherited)."""
        self.released = True
        self.closing = True
        try:
            self._release()
        except OSError:
            logger.warning("releasing a %s queue failed", self.engine_name, exc_info=True)
        self._notify_released()

    def _notify_released(self) -> None:
        hook, self.on_release = self.on_release, None
        if hook is not None:
            method = hook()
            if method is not None:
                method()

    def __del__(self) -> None:
        try:
            if not self.released:
                if any(s.inflight for s in self.active.values()):
                    logger.warning("a %s queue was dropped with reads in flight; their buffers stay "
                                   "quarantined", self.engine_name)
                    for sub in list(self.active.values()):
                        sub.finish(drained=False)
                self.released = True
                self._release()
                self._notify_released()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to report to
            pass
