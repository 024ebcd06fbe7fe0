"""The read-engine contract: one call hands over every extent of a read; the engine keeps
them in flight and reports when all are done.

An engine moves bytes and nothing else: the posix reader plans the extents
(`plan_extents`), owns the file descriptors and the page-aligned destination buffer, and
parses the result. `submit` returns at once with the reads in flight; `EngineRead.wait`
blocks until every extent has finished. There is no Python work per extent on the
submitting side of the native engines (`io_uring`, `aio`): offsets and lengths go to
the kernel as numpy arrays.

Threads: an engine is shared by every thread of a process. Ring-based engines keep one
ring per submitting thread, so `wait` must run on the thread that called `submit`.

The ownership rule
------------------
Memory handed to a read belongs to the kernel (or to the engine's worker threads) until
every read that targets it has completed, or been cancelled, **and been reaped**. Only
then may it return to a pool, be reused or be freed. Every path keeps it:

- `submit` either returns an `EngineRead` that owns the reads it started, or raises
  having started nothing that is still in flight (it drains what it started first).
- `EngineRead.wait` raises only once the read is drained, except when the kernel stops
  answering (a read stuck past `IoLimits.timeout_s`, a ring that refuses every call):
  then `drained` stays False and the buffer must be quarantined, not returned.
- `EngineRead.cancel` withdraws what the kernel has not taken yet; what it has taken is
  reaped by the next `wait` (or by the queue's next exchange).
- `ReadEngine.close` waits for (or cancels and reaps) every read of every thread before
  it releases a ring or a context; a closed engine refuses new reads (`StoreClosedError`).

It is enforced in one place, the ledger: every read claims the address range of its
buffer in `LEDGER` when it starts and settles the claim only once it is drained. The
pools (`espn.store.buffers.BufferPool`, `espn.store.kvikio.DeviceBufferPool`) ask the ledger
through one `ReturnGuard` whenever a buffer comes back: a buffer still claimed is never
reused. Under the strict policy (the test suite's) that is an `OwnershipError`; in
production it is logged and the buffer is quarantined until its claims settle. With the
canary on, a returned buffer is filled with `CANARY` and checked when it is handed out
again, so a late write by the kernel into memory that was given back is caught.

Transient errors (`TRANSIENT_ERRNOS`: EAGAIN, EBUSY, ENOMEM, EINTR) from the syscalls and
from single reads are retried with bounded exponential backoff (`IoLimits`), after
reaping what has completed; a read that exhausts its budget fails with one `ReadError`
naming the file, the offset and the errno.

`inject_faults` is the test hook: a `FaultInjector` sees every syscall, every batch of
results and a few named points of the read path, and may fail or shorten them, as a
loaded kernel would, without any private name being patched.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np

from ...errors import EspnError, InvalidParameterError

__all__ = [
    "CANARY",
    "EngineRead",
    "EngineUnavailable",
    "FaultInjector",
    "IoLimits",
    "LEDGER",
    "BufferLedger",
    "OwnershipError",
    "OwnershipPolicy",
    "ReadEngine",
    "ReadError",
    "ReturnGuard",
    "StoreClosedError",
    "TRANSIENT_ERRNOS",
    "check_extents",
    "current_faults",
    "describe_fd",
    "inject_faults",
    "ownership_policy",
    "set_ownership_policy",
]

logger = logging.getLogger(__name__)

#: Errors the kernel documents as "try again" (io_uring_enter(2), io_submit(2), io_getevents(2)).
TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EBUSY, errno.ENOMEM, errno.EINTR})

#: The byte a pool writes over a buffer given back to it when the canary is on.
CANARY = 0xA5


class EngineUnavailable(RuntimeError):
    """This engine cannot run here (syscall refused by seccomp, sysctl, old kernel...)."""


class StoreClosedError(EspnError, ValueError):
    """A read was started on a reader or an engine that is closed (or closing)."""


class OwnershipError(RuntimeError):
    """A buffer went back to its pool while a read could still write into it, or the kernel
    wrote into a buffer after it was given back (strict policy only; see the module doc)."""


class ReadError(OSError):
    """One read failed for good: the file, the offset and the errno, and why it was final."""

    def __init__(self, err: int, path: str, offset: int, detail: str = "") -> None:
        super().__init__(err, os.strerror(err))
        self.filename = path
        self.offset = offset
        self.detail = detail

    def __str__(self) -> str:
        name = errno.errorcode.get(self.errno or 0, str(self.errno))
        tail = f" {self.detail}" if self.detail else ""
        return f"reading {self.filename} at offset {self.offset} failed: {name} ({self.strerror}){tail}"

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.errno, self.filename, self.offset, self.detail)


def describe_fd(fd: int) -> str:
    """The path behind a descriptor, for error messages (only read on the error path)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"


@dataclasses.dataclass(frozen=True)
class IoLimits:
    """How long an engine keeps trying before a read fails.

    max_retries:   transient failures one read (or one syscall that makes no progress) may
                   see before it fails with a ReadError naming the errno
    backoff_s:     first pause after a transient failure; doubles per retry ...
    max_backoff_s: ... up to this (32 retries take about 0.5 s in all)
    timeout_s:     a wait that sees no completion for this long cancels what is in flight
                   and fails with ETIMEDOUT; `close` waits this long for other threads'
                   reads to drain before it leaves their buffers quarantined
    """

    max_retries: int = 32
    backoff_s: float = 50e-6
    max_backoff_s: float = 0.02
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise InvalidParameterError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")
        for name in ("backoff_s", "max_backoff_s", "timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidParameterError(f"{name} must be a number > 0, got {value!r}")

    def pause(self, attempt: int) -> None:
        """Sleep before retry number `attempt` (1, 2, ...) of a transient failure."""
        time.sleep(min(self.max_backoff_s, self.backoff_s * (1 << min(attempt - 1, 30))))


# -- the ledger ----------------------------------------------------------------------------


class BufferLedger:
    """Address ranges that reads in flight may still write into (process-wide).

    A read claims its buffer when it starts and settles the claim once drained. A claim
    may carry `poll`, a cheap non-blocking "has it drained?" (worker threads' futures), so
    that a quarantined buffer comes back even when nobody waits for its read. The number
    of claims is the number of reads in flight (tens), so a linear scan is cheap.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: dict[int, tuple[int, int, Callable[[], bool] | None]] = {}
        self._next = 1

    def claim(self, address: int, nbytes: int, poll: Callable[[], bool] | None = None) -> int:
        """Claim [address, address + nbytes); a token for `settle`."""
        with self._lock:
            token = self._next
            self._next += 1
            self._claims[token] = (address, address + max(1, nbytes), poll)
        return token

    def settle(self, token: int) -> None:
        with self._lock:
            self._claims.pop(token, None)

    def claimed(self, address: int, nbytes: int) -> bool:
        """Does a read in flight target any byte of [address, address + nbytes)?"""
        end = address + max(1, nbytes)
        with self._lock:
            hits = [(token, poll) for token, (start, stop, poll) in self._claims.items()
                    if start < end and address < stop]
        for token, poll in hits:
            if poll is None or not poll():
                return True
            self.settle(token)
        return False

    def outstanding(self) -> int:
        """Claims not settled yet (reads in flight, or stuck ones)."""
        with self._lock:
            return len(self._claims)

    def forget_all(self) -> None:
        """After fork, in the child: the parent's reads write into the parent's pages."""
        self._claims = {}
        self._lock = threading.Lock()


LEDGER = BufferLedger()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=LEDGER.forget_all)


@dataclasses.dataclass(frozen=True)
class OwnershipPolicy:
    """strict: a buffer given back while claimed raises OwnershipError (tests); otherwise it
    is logged and quarantined (production). canary: pools fill given-back buffers with
    CANARY and check them when handing them out again (tests; costs a memset and a compare)."""

    strict: bool = False
    canary: bool = False


_policy = OwnershipPolicy()


def ownership_policy() -> OwnershipPolicy:
    return _policy


def set_ownership_policy(policy: OwnershipPolicy) -> OwnershipPolicy:
    """Set the process-wide policy; returns the previous one."""
    global _policy
    previous, _policy = _policy, policy
    return previous


class ReturnGuard:
    """What a pool runs whenever a buffer comes back: the ledger check, the quarantine and
    the canary. The one place where the ownership rule is enforced.

    fill(buffer) writes CANARY over a buffer, intact(buffer) checks it; address(buffer)
    gives (address, nbytes) of its memory.
    """

    def __init__(self, what: str, address: Callable[[Any], tuple[int, int]], fill: Callable[[Any], None],
                 intact: Callable[[Any], bool]) -> None:
        self.what = what
        self._address = address
        self._fill = fill
        self._intact = intact
        self._lock = threading.Lock()
        self._quarantine: list[Any] = []
        self._poisoned: set[int] = set()  # id() of buffers carrying the canary

    def give_back(self, buffer: Any, known_in_flight: bool = False) -> bool:
        """True when `buffer` may be kept for reuse now; False when it is quarantined.

        known_in_flight: the caller knows reads may still target it (a failure it could not
        drain); it is quarantined without an ownership error.
        """
        address, nbytes = self._address(buffer)
        if LEDGER.claimed(address, nbytes):
            with self._lock:
                self._quarantine.append(buffer)
            if known_in_flight:
                logger.warning("a %s is quarantined until the reads still targeting it drain", self.what)
                return False
            message = (f"a {self.what} was given back while a read in flight still targets it "
                       f"(address {address:#x}, {nbytes} bytes); quarantined until that read drains")
            if _policy.strict:
                raise OwnershipError(message)
            logger.error(message)
            return False
        if _policy.canary:
            self._fill(buffer)
            with self._lock:
                self._poisoned.add(id(buffer))
        return True

    def handing_out(self, buffer: Any) -> None:
        """Check the canary of a buffer about to be reused (OwnershipError if it changed)."""
        with self._lock:
            poisoned = id(buffer) in self._poisoned
            self._poisoned.discard(id(buffer))
        if poisoned and not self._intact(buffer):
            raise OwnershipError(f"a {self.what} changed after it was given back: "
                                 "a read wrote into memory it no longer owned")

    def check(self, buffers: list[Any]) -> None:
        """Check the canary of free `buffers` now (tests; OwnershipError if one changed)."""
        with self._lock:
            poisoned = [b for b in buffers if id(b) in self._poisoned]
        for buffer in poisoned:
            if not self._intact(buffer):
                raise OwnershipError(f"a {self.what} changed after it was given back: "
                                     "a read wrote into memory it no longer owned")

    def forget(self, buffer: Any) -> None:
        with self._lock:
            self._poisoned.discard(id(buffer))

    def reclaim(self) -> list[Any]:
        """Quarantined buffers whose reads have drained: out of quarantine, for the pool."""
        with self._lock:
            if not self._quarantine:
                return []
            free = [b for b in self._quarantine if not LEDGER.claimed(*self._address(b))]
            if free:
                self._quarantine = [b for b in self._quarantine if all(b is not f for f in free)]
        return free

    @property
    def quarantined(self) -> int:
        """Buffers in quarantine (read without the lock: a hint for the pools' fast path)."""
        return len(self._quarantine)


# -- fault injection (the test hook) --------------------------------------------------------


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


# -- the contract ---------------------------------------------------------------------------


class EngineRead(abc.ABC):
    """Extents in flight."""

    @abc.abstractmethod
    def wait(self) -> np.ndarray:
        """Block until every extent is done; [m] int64 bytes read per extent.

        A count below the extent's length means the file ended there (the caller zero-fills
        the rest); any other short transfer is completed by the engine. Raises OSError (a
        ReadError naming the file and offset for a failed read) only after every extent
        has finished, so nothing writes into the buffer once `wait` has returned or raised,
        unless `drained` says otherwise (a read stuck past the time limit). Idempotent.
        """

    @property
    @abc.abstractmethod
    def drained(self) -> bool:
        """No extent is with the kernel or a worker, and none will be handed over again:
        nothing can write into the buffer any more."""

    def cancel(self) -> None:
        """Withdraw the extents not yet handed to the kernel (they fail with ECANCELED); the
        ones it has are reaped by `wait`, which must still be called. Idempotent."""


class ReadEngine(abc.ABC):
    """Reads extents of a file into slices of one buffer.

    name:   what users pass (`--io-engine`, `ESPN_IO_ENGINE`) and what `reader.engine` says
    depth:  how many extents it keeps in flight at once (queue depth, or threads)
    limits: retries, backoff and time limits (`IoLimits`)
    """

    name: ClassVar[str]

    def __init__(self, depth: int = 64, limits: IoLimits | None = None, **options: Any) -> None:
        if options:
            raise InvalidParameterError(f"unknown option(s) for the {self.name!r} engine: {', '.join(sorted(options))}")
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 4096:
            raise InvalidParameterError(f"io_depth must be an integer in [1, 4096], got {depth!r}")
        if limits is not None and not isinstance(limits, IoLimits):
            raise InvalidParameterError(f"limits must be an IoLimits, got {limits!r}")
        self.depth = depth
        self.limits = limits or IoLimits()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this engine cannot run on this host, or None. Cheap enough to call at open."""
        return None

    @abc.abstractmethod
    def submit(self, fd: int, file_offsets: np.ndarray, lengths: np.ndarray, buffer: np.ndarray,
               buffer_offsets: np.ndarray) -> EngineRead:
        """Start reading extent i (`lengths[i]` bytes at `file_offsets[i]` of `fd`) into
        `buffer[buffer_offsets[i]:][:lengths[i]]`; returns without waiting.

        file_offsets, lengths, buffer_offsets: [m] int64 (m >= 1); buffer: 1-D writable
        uint8, page-aligned where `fd` is opened with O_DIRECT. The caller keeps `buffer`
        alive and untouched until the read is drained. Raises StoreClosedError once the
        engine is closed, and nothing else once a read has started (its errors come from
        `wait`), except an exception such as KeyboardInterrupt, after draining.
        """

    def close(self) -> None:
        """Wait for (or cancel and reap) every read in flight, then release rings, contexts
        and threads; later submits raise StoreClosedError. Idempotent."""

    def when_idle(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the engine is closed and no read is in flight any more: at
        once, or from the thread whose reads drain last (the posix reader closes its file
        descriptor here, so that no read still queued can find its number reused)."""
        callback()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(depth={self.depth})"


def buffer_span(buffer: np.ndarray) -> tuple[int, int]:
    """(address, nbytes) of a 1-D uint8 numpy buffer, as the ledger keys it."""
    return int(buffer.__array_interface__["data"][0]), int(buffer.nbytes)


def check_extents(file_offsets: np.ndarray, lengths: np.ndarray, buffer: np.ndarray,
                  buffer_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate one submission (shapes, bounds) and return the arrays as int64."""
    file_offsets = np.asarray(file_offsets, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    buffer_offsets = np.asarray(buffer_offsets, dtype=np.int64)
    if not file_offsets.shape == lengths.shape == buffer_offsets.shape or file_offsets.ndim != 1:
        raise ValueError("file_offsets, lengths and buffer_offsets must be 1-D arrays of one length")
    if buffer.dtype != np.uint8 or buffer.ndim != 1 or not buffer.flags.writeable:
        raise ValueError("buffer must be a writable 1-D uint8 array")
    if len(lengths) and (lengths.min() < 0 or file_offsets.min() < 0 or buffer_offsets.min() < 0
                         or int((buffer_offsets + lengths).max()) > len(buffer)):
        raise ValueError("an extent falls outside the buffer or has a negative offset or length")
    return file_offsets, lengths, buffer_offsets


def realign(done: int, file_offset: int, address: int) -> int:
    """Where to resume a short read: `done` rounded down to the alignment the extent had.

    Under O_DIRECT the kernel wants offset, address and length aligned to the device's
    logical block; resuming from an unaligned count would be refused with EINVAL. The
    extent's own alignment (the lowest set bit of its offset and address, at most 4096)
    was accepted, so re-reading the aligned block that holds the remainder always is.
    """
    both = file_offset | address
    unit = min(4096, both & -both) if both else 4096
    return done - done % unit
