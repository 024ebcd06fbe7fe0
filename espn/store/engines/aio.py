"""The Linux AIO engine: raw `io_setup` / `io_submit` / `io_getevents` from Python with
ctypes, iocbs filled with numpy.

The fallback where io_uring is refused (container seccomp profiles that refuse io_uring
usually allow AIO). With `O_DIRECT` the reads are asynchronous like io_uring's; on the
buffered fallback descriptor the kernel performs them inside `io_submit`, which is still
correct, just synchronous. One AIO context per submitting thread, like the rings (so the
same rule: `wait()` runs on the submitting thread), `depth` reads in flight per context.
A batch is one `io_submit` of an array of iocb pointers (looped only if the kernel takes
fewer); `wait` is `io_getevents`. The kernel copies each iocb at `io_submit`, so the iocb
array is reused for the next batch. Results go through the same bookkeeping as io_uring
(`native.KernelQueue`): completions attributed by `aio_data` = submission id << 32 |
extent, retries of transient results and of short transfers before the end of the file,
errors raised once every extent has finished.

Failures: EAGAIN, EBUSY, ENOMEM and EINTR from `io_submit` ("insufficient resources") and
`io_getevents` (a signal) are retried after reaping what has completed, with backoff, at
most `IoLimits.max_retries` times in a row; then the iocbs the kernel never took fail with
that errno. Waits carry `io_getevents`' own timeout. AIO cannot cancel a file read in
flight, so a read stuck past `IoLimits.timeout_s` breaks the context: its buffer stays
quarantined and the context is left to the kernel rather than destroyed (`io_destroy`
would wait for the stuck read).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import platform
import sys

import numpy as np

from .errors import TRANSIENT_ERRNOS
from .faults import current_faults
from .limits import IoLimits
from .kernel_queue import KernelQueue
from .native import NativeEngine, probe_read
from .submission import WITHDRAWN, QueueBroken
from .uring_abi import libc_syscall, syscall

__all__ = ["AioEngine", "IOCB_DTYPE", "IO_EVENT_DTYPE"]

logger = logging.getLogger(__name__)

#: (io_setup, io_destroy, io_submit, io_getevents) per architecture.
_SYSCALLS = {
    "x86_64": (206, 207, 209, 208),
    "amd64": (206, 207, 209, 208),
    "aarch64": (0, 1, 2, 4),
    "arm64": (0, 1, 2, 4),
}
IOCB_CMD_PREAD = 0

_u2, _u4, _u8, _i2, _i4, _i8 = np.uint16, np.uint32, np.uint64, np.int16, np.int32, np.int64
#: struct iocb (64 bytes, little-endian field order)
IOCB_DTYPE = np.dtype([("aio_data", _u8), ("aio_key", _u4), ("aio_rw_flags", _i4), ("aio_lio_opcode", _u2),
                       ("aio_reqprio", _i2), ("aio_fildes", _u4), ("aio_buf", _u8), ("aio_nbytes", _u8),
                       ("aio_offset", _i8), ("aio_reserved2", _u8), ("aio_flags", _u4), ("aio_resfd", _u4)])
#: struct io_event (32 bytes)
IO_EVENT_DTYPE = np.dtype([("data", _u8), ("obj", _u8), ("res", _i8), ("res2", _i8)])
if IOCB_DTYPE.itemsize != 64 or IO_EVENT_DTYPE.itemsize != 32:
    raise ImportError("struct iocb / io_event layouts are not the kernel's 64 / 32 bytes")


def _numbers() -> tuple[int, int, int, int]:
    return _SYSCALLS[platform.machine().lower()]


def io_setup(nr_events: int) -> int:
    """A new AIO context able to hold `nr_events` requests in flight."""
    ctx = ctypes.c_ulong(0)
    syscall(_numbers()[0], nr_events, ctypes.addressof(ctx))
    return int(ctx.value)


def io_destroy(ctx: int) -> None:
    syscall(_numbers()[1], ctx)


class _Context(KernelQueue):
    """One AIO context and an event array; iocbs live with their submission."""

    engine_name = "aio"

    def __init__(self, capacity: int, limits: IoLimits | None = None) -> None:
        self.ctx = io_setup(capacity)
        super().__init__(capacity, limits)
        _, _, self._nr_submit, self._nr_getevents = _numbers()
        self._sys = libc_syscall()
        self._events = np.zeros(capacity, dtype=IO_EVENT_DTYPE)
        self._events_address = self._events.ctypes.data
        self._timespec = np.zeros(2, dtype=np.int64)  # struct timespec for io_getevents
        self._timespec_address = int(self._timespec.ctypes.data)
        self._timeout = -1.0  # what the timespec holds now
        # (iocbs, their pointers, the pointers' address, start, stop): the arrays stay referenced here.
        self._staged: list[tuple[np.ndarray, np.ndarray, int, int, int]] = []
        self._with_kernel = 0  # submitted and not reaped (excludes requests refused at io_submit)
        self._wait_failures = 0  # transient failures of io_getevents in a row
        self._reaped: list[np.ndarray] = []  # events reaped during one _exchange

    def _prepare(self, fd: int, offsets: np.ndarray, addrs: np.ndarray, lengths: np.ndarray,
                 user_data: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """k iocbs (IOCB_CMD_PREAD), the [k] uint64 array of their addresses io_submit takes,
        and that array's own address."""
        iocbs = np.zeros(len(lengths), dtype=IOCB_DTYPE)
        iocbs["aio_lio_opcode"] = IOCB_CMD_PREAD
        iocbs["aio_fildes"] = fd
        iocbs["aio_offset"] = offsets
        iocbs["aio_buf"] = addrs
        iocbs["aio_nbytes"] = lengths
        iocbs["aio_data"] = user_data
        pointers = iocbs.ctypes.data + np.arange(len(lengths), dtype=np.uint64) * np.uint64(IOCB_DTYPE.itemsize)
        return iocbs, pointers, int(pointers.ctypes.data)

    def _issue(self, requests: tuple[np.ndarray, np.ndarray, int], start: int, stop: int) -> None:
        self._staged.append((*requests, start, stop))

    def _io_submit(self, count: int, address: int) -> int:
        """io_submit(2): iocbs taken, or -errno."""
        faults = current_faults()
        if faults is not None:
            err = faults.syscall("io_submit")
            if err:
                return -err
        ret = self._sys(self._nr_submit, self.ctx, count, address, 0, 0, 0)
        return int(ret) if ret >= 0 else -ctypes.get_errno()

    def _io_getevents(self, min_complete: int, timeout: float | None) -> int:
        """io_getevents(2) into self._events: events reaped, or -errno."""
        faults = current_faults()
        if faults is not None:
            err = faults.syscall("io_getevents")
            if err:
                return -err
        pointer = 0
        if timeout is not None:
            if timeout != self._timeout:  # the same limit wait after wait: set it once
                seconds = int(timeout)
                self._timespec[0] = seconds
                self._timespec[1] = int((timeout - seconds) * 1e9)
                self._timeout = timeout
            pointer = self._timespec_address
        ret = self._sys(self._nr_getevents, self.ctx, min_complete, len(self._events), self._events_address,
                        pointer, 0)
        return int(ret) if ret >= 0 else -ctypes.get_errno()

    def _submit_staged(self) -> tuple[list[int], list[int]]:
        """io_submit every staged iocb; those the kernel refuses come back as failures.

        Progress is written back to `_staged` after every call, so an exception between two
        calls leaves exactly the iocbs the kernel has not taken staged."""
        failed_data: list[int] = []
        failed_res: list[int] = []
        failures = 0
        while self._staged:
            iocbs, pointers, address, done, stop = self._staged[0]
            if done >= stop:
                self._staged.pop(0)
                continue
            n = self._io_submit(stop - done, address + 8 * done)
            if n > 0:
                self._staged[0] = (iocbs, pointers, address, done + n, stop)
                self._with_kernel += n
                failures = 0
                continue
            err = -n if n < 0 else errno.EAGAIN  # 0: the kernel took nothing
            if err in TRANSIENT_ERRNOS and failures < self.limits.max_retries:
                failures += 1
                if err == errno.EINTR:
                    continue
                if self._with_kernel:  # out of kernel resources: let some finish first
                    self._wait_events(1, self.limits.backoff_s * (1 << min(failures, 20)))
                else:
                    self.limits.pause(failures)
                continue
            if err in TRANSIENT_ERRNOS:  # the budget is spent: what the kernel never took fails
                failed_data.extend(iocbs["aio_data"][done:stop].tolist())
                failed_res.extend([-(err + WITHDRAWN)] * (stop - done))
                self._staged[0] = (iocbs, pointers, address, stop, stop)
                failures = 0
                continue
            # io_submit reports an error only for the first iocb of the call (bad fd,
            # misaligned O_DIRECT...): that read has failed; carry on with the next.
            failed_data.append(int(iocbs["aio_data"][done]))
            failed_res.append(-err)
            self._staged[0] = (iocbs, pointers, address, done + 1, stop)
        return failed_data, failed_res

    def _wait_events(self, min_complete: int, timeout: float | None) -> None:
        """Reap at least `min_complete` events (all that are ready, up to capacity), or what
        arrived within `timeout`, or nothing after a transient failure (the caller's time
        limit bounds those); QueueBroken when the context refuses."""
        n = self._io_getevents(min_complete, timeout)
        if n < 0:
            if -n not in TRANSIENT_ERRNOS:
                raise QueueBroken(-n, f"io_getevents cannot reap completions: {os.strerror(-n)}")
            self._wait_failures += 1
            if -n != errno.EINTR:
                self.limits.pause(self._wait_failures)
            return
        self._wait_failures = 0
        if n:
            self._reaped.append(self._events[:n].copy())
            self._with_kernel -= n

    def _exchange(self, min_complete: int, timeout: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        self._reaped = []
        failed_data, failed_res = self._submit_staged() if self._staged else ([], [])
        got = sum(len(e) for e in self._reaped)
        need = min(min_complete - len(failed_data) - got, self._with_kernel)
        if need > 0:
            self._wait_events(need, timeout)
        reaped, self._reaped = self._reaped, []
        if not failed_data:
            if not reaped:
                return _EMPTY_U64, _EMPTY_I64
            if len(reaped) == 1:
                rows = reaped[0].view(np.uint64).reshape(-1, 4)  # data, obj, res, res2
                return rows[:, 0], rows.view(np.int64)[:, 2]
        events = np.concatenate(reaped) if reaped else np.zeros(0, dtype=IO_EVENT_DTYPE)
        user_data = np.concatenate([events["data"], np.asarray(failed_data, dtype=np.uint64)])
        res = np.concatenate([events["res"], np.asarray(failed_res, dtype=np.int64)])
        return user_data, res

    def _cancel_in_flight(self) -> bool:
        return False  # io_cancel(2) does not cancel file reads on the kernels that matter

    def _release(self) -> None:
        ctx, self.ctx = getattr(self, "ctx", 0), 0
        if not ctx:
            return
        if self.broken is not None and self._with_kernel:
            # io_destroy waits for every read in flight, and these do not complete: leave the
            # context to the kernel (it goes with the process).
            logger.warning("leaving a broken AIO context with %d read(s) in flight to the kernel", self._with_kernel)
            return
        io_destroy(ctx)  # waits for (or cancels) anything still in flight


_EMPTY_U64 = np.zeros(0, dtype=np.uint64)
_EMPTY_I64 = np.zeros(0, dtype=np.int64)


@functools.lru_cache(maxsize=1)
def probe() -> str | None:
    """Why Linux AIO cannot run here, or None; tried once per process (clear with cache_clear)."""
    if not sys.platform.startswith("linux"):
        return "Linux AIO is Linux only"
    if platform.machine().lower() not in _SYSCALLS:
        return f"no AIO syscall numbers for {platform.machine()!r} (known: x86_64, aarch64)"
    try:
        context = _Context(2)
    except OSError as exc:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        hint = {errno.ENOSYS: "; the kernel lacks CONFIG_AIO, or a seccomp profile hides it",
                errno.EPERM: "; probably a seccomp profile",
                errno.EAGAIN: "; the system-wide fs.aio-max-nr is used up"}.get(exc.errno or 0, "")
        return f"io_setup refused: {exc.strerror} ({name}){hint}"
    return probe_read(context, "AIO")


class AioEngine(NativeEngine):
    """Linux native AIO: one context per submitting thread, `depth` reads in flight each."""

    name = "aio"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return probe()

    def _new_queue(self) -> KernelQueue:
        return _Context(self.depth, self.limits)
