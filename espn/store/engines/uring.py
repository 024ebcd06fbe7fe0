"""The io_uring engine: raw `io_uring_setup` / `io_uring_enter` from Python with ctypes,
submission and completion rings driven with numpy.

Why raw syscalls: no compiler and no dependency. The Python bindings do not fit (pyuring
is alpha and copies every read into a new `bytes`, where we need the kernel to write into
slices of one page-aligned buffer); a C extension would have to build in every image
(CPU, CUDA, ARM). The kernel interface is small: three mmaps, a 64-byte SQE, a 16-byte
CQE. A submission's SQEs are built once, one vectorised assignment per field of the
`SQE_DTYPE` record (opcode, fd, off, addr, len, user_data), and copied into the SQ as
plain uint64 rows, a slice at a time as slots free up; one `io_uring_enter` submits each
slice (and waits for completions in the same call); completions are read as one numpy
slice of the CQ. No Python work per extent.

Measured (`python -m benchmarks.bench_io --index /data/synth2m --seconds 5 --repeats 3`:
5.4 GiB embeddings.bin, random 4 KiB O_DIRECT reads, 2,048 per call, depth 32, a virtio
disk on a shared 2-core EPYC VM, Linux 6.18; medians of 3 rounds alternating with fio):
fio --ioengine=io_uring --iodepth=32: 99k IOPS at 6.6 us CPU per read (0.6 in user
space); this engine: 83k IOPS (83%) at 4.7 us (1.2 in user space: the Python); aio 72%
at 5.1 us; the threads engine 43% at 18 us. Through the posix reader at its default
depth 64: 98% of fio at 4.3 us. The device's speed varies from run to run (fio from 99k
to 149k IOPS; at 149k this engine made 79%, the reader at depth 64 80%). Most of the CPU
per read is the kernel's (virtio submission and completion), which fio pays too, so a
budget of 2 us per read is met by the engine's own (user-space) share only.

One ring per submitting thread (`threading.local`), made at its first `submit`, released
by `close()`: with IORING_SETUP_SINGLE_ISSUER and DEFER_TASKRUN (6.1+) only that thread may
submit and reap, so `wait()` runs on it. SQ entries = depth rounded up to a power of two,
the CQ twice that; at most `depth` reads in flight per ring, so the CQ never overflows;
larger submissions go in slices as completions free slots.

Memory ordering, as liburing does it: the SQ tail is a plain store (the kernel reads it
inside our own `io_uring_enter`, in program order after our SQE stores, since we use no
SQPOLL thread); the CQ tail is read with acquire semantics before the CQEs it covers, and
the CQ head is written with release semantics after they have been copied out. On x86-64
(total store order) every load is an acquire and every store a release, and each access
from Python is a separate C call the compiler cannot reorder, so plain loads and stores
are those semantics. Elsewhere (ARM64: weak ordering) a ten-line C helper with
`__atomic_load_n(..., __ATOMIC_ACQUIRE)` / `__atomic_store_n(..., __ATOMIC_RELEASE)` is
compiled at first use with the system's C compiler (`ring_index_access`); where there is
none, io_uring is not chosen and the reader falls back to AIO with one log line.

Failures: see `native.py`. `_exchange` retries EAGAIN, EBUSY, ENOMEM and EINTR from
`io_uring_enter` (and a call that took nothing) after reaping and a pause, at most
`IoLimits.max_retries` times in a row; then the SQEs the kernel never consumed are taken
back (the SQ tail rewound to the kernel's head: without SQPOLL nothing else reads them)
and their reads fail with that errno. Waits carry a timeout (IORING_ENTER_EXT_ARG, 5.11): a
read that never completes ends in IORING_ASYNC_CANCEL_ANY (5.19) and ETIMEDOUT, not a hang.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from ...errors import InvalidParameterError
from .errors import TRANSIENT_ERRNOS, EngineUnavailable
from .faults import current_faults
from .kernel_queue import KernelQueue
from .limits import IoLimits
from .native import NativeEngine, probe_read
from .submission import WITHDRAWN, QueueBroken
from .uring_abi import (ARCHES, CQE_DTYPE, IORING_ASYNC_CANCEL_ANY, IORING_ENTER_EXT_ARG, IORING_ENTER_GETEVENTS,
                        IORING_FEAT_EXT_ARG, IORING_FEAT_SINGLE_MMAP, IORING_OFF_CQ_RING, IORING_OFF_SQES,
                        IORING_OFF_SQ_RING, IORING_OP_ASYNC_CANCEL, IORING_OP_READ, IORING_REGISTER_PROBE,
                        IO_URING_OP_SUPPORTED, NR_ENTER, NR_REGISTER, PARAMS_DTYPE,
                        SETUP_FLAGS, SQE_DTYPE, io_uring_enter, io_uring_setup, libc_syscall, round_up_pow2, syscall)

__all__ = ["UringEngine", "SQE_DTYPE", "CQE_DTYPE", "PARAMS_DTYPE", "io_uring_setup", "io_uring_enter",
           "ring_index_access", "find_c_compiler"]

logger = logging.getLogger(__name__)

# -- ring indices: acquire / release ----------------------------------------------------------

#: Machines whose hardware memory model is total store order: a plain load is an acquire, a
#: plain store a release.
_TSO_MACHINES = {"x86_64", "amd64"}

_ATOMICS_SOURCE = r"""
#include <stdint.h>
/* liburing's io_uring_smp_load_acquire / io_uring_smp_store_release on a u32 ring index. */
uint32_t espn_load_acquire_u32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void espn_store_release_u32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
"""


def find_c_compiler() -> str | None:
    """The system C compiler (cc, gcc or clang on PATH), or None."""
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


@functools.lru_cache(maxsize=None)
def _compiled_atomics(compiler: str) -> tuple[Any, Any] | str:
    """(load_acquire, store_release) from the C helper built with `compiler`, or why not.

    Built once per process into a temporary directory (removed at once: the mapping stays).
    """
    try:
        with tempfile.TemporaryDirectory(prefix="espn-atomics-") as work:
            source, library = os.path.join(work, "atomics.c"), os.path.join(work, "atomics.so")
            with open(source, "w") as f:
                f.write(_ATOMICS_SOURCE)
            proc = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", library, source],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                return f"{compiler} failed: {proc.stderr.strip()[-300:]}"
            lib = ctypes.CDLL(library)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{compiler} could not build it: {exc}"
    load, store = lib.espn_load_acquire_u32, lib.espn_store_release_u32
    load.restype, load.argtypes = ctypes.c_uint32, [ctypes.c_void_p]
    store.restype, store.argtypes = None, [ctypes.c_void_p, ctypes.c_uint32]
    probe = ctypes.c_uint32(0)
    store(ctypes.addressof(probe), 0xE5B1)
    if load(ctypes.addressof(probe)) != 0xE5B1:
        return "the compiled helper does not round-trip a value"
    return load, store


def ring_index_access(machine: str, atomics: str = "auto", compiler: str | None = None) -> tuple[str | None, str]:
    """How ring indices get acquire/release semantics on `machine`: ("plain" | "compiled", why),
    or (None, why not). atomics="compiled" asks for the C helper even where plain would do
    (it is what other architectures run; the tests use it here too)."""
    if atomics == "auto" and machine.lower() in _TSO_MACHINES:
        return "plain", f"{machine} orders memory totally (TSO): plain loads and stores acquire and release"
    compiler = compiler or find_c_compiler()
    if compiler is None:
        return None, (f"no C compiler to build the ring's acquire/release helper for {machine} "
                      "(install gcc or clang, or use the aio engine)")
    built = _compiled_atomics(compiler)
    if isinstance(built, str):
        return None, f"the ring's acquire/release helper for {machine} did not build: {built}"
    return "compiled", f"acquire/release through a helper compiled with {compiler}"


class _Word:
    """One u32 ring index in a mapping: plain access (what liburing's READ_ONCE / WRITE_ONCE
    compile to), and acquire / release (plain on TSO machines, else the compiled helper)."""

    __slots__ = ("view", "address", "load_acquire", "store_release")

    def __init__(self, m: mmap.mmap, offset: int, compiled: tuple[Any, Any] | None) -> None:
        self.view = memoryview(m)[offset: offset + 4].cast("I")
        self.address = ctypes.addressof(ctypes.c_uint32.from_buffer(m, offset)) if compiled else 0
        if compiled is None:
            self.load_acquire = self._plain_load
            self.store_release = self._plain_store
        else:
            load, store = compiled
            self.load_acquire = functools.partial(load, self.address)
            self.store_release = functools.partial(store, self.address)

    def _plain_load(self) -> int:
        return self.view[0]

    def _plain_store(self, value: int) -> None:
        self.view[0] = value


class _Ring(KernelQueue):
    """One io_uring instance: SQ, CQ and SQE array mapped and viewed through numpy."""

    engine_name = "io_uring"

    def __init__(self, capacity: int, limits: IoLimits | None = None, atomics: str = "plain") -> None:
        entries = round_up_pow2(max(capacity, 2))
        params = np.zeros(1, dtype=PARAMS_DTYPE)
        for flags in SETUP_FLAGS:
            params[:] = 0
            params["flags"] = flags
            try:
                fd = io_uring_setup(entries, params)
                break
            except OSError as exc:
                if exc.errno != errno.EINVAL or flags == SETUP_FLAGS[-1]:
                    raise
        super().__init__(min(capacity, entries), limits)
        self.fd = fd
        self.setup_flags = int(params["flags"][0])
        self.atomics = atomics
        os.set_inheritable(fd, False)  # the kernel makes it O_CLOEXEC already; say so anyway
        p = params[0]
        sq, cq = p["sq_off"], p["cq_off"]
        self.features = int(p["features"])
        self.sq_entries, self.cq_entries = int(p["sq_entries"]), int(p["cq_entries"])
        sq_size = int(sq["array"]) + self.sq_entries * 4
        cq_size = int(cq["cqes"]) + self.cq_entries * CQE_DTYPE.itemsize
        single = bool(self.features & IORING_FEAT_SINGLE_MMAP)
        if single:
            sq_size = cq_size = max(sq_size, cq_size)
        self._maps: list[mmap.mmap] = []
        self._words: list[_Word] = []
        try:
            sq_map = self._map(sq_size, IORING_OFF_SQ_RING)
            cq_map = sq_map if single else self._map(cq_size, IORING_OFF_CQ_RING)
            sqe_map = self._map(self.sq_entries * SQE_DTYPE.itemsize, IORING_OFF_SQES)
            compiled = None
            if atomics == "compiled":
                built = _compiled_atomics(find_c_compiler() or "cc")
                if isinstance(built, str):
                    raise OSError(errno.ENOSYS, built)
                compiled = built

            def word(m: mmap.mmap, offset: Any) -> _Word:
                w = _Word(m, int(offset), compiled)
                self._words.append(w)
                return w

            self._sq_head = word(sq_map, sq["head"])
            self._sq_tail = word(sq_map, sq["tail"])
            self._cq_head = word(cq_map, cq["head"])
            self._cq_tail = word(cq_map, cq["tail"])
        except BaseException:
            self._release()
            raise

        def u32(m: mmap.mmap, offset: Any, count: int = 1) -> np.ndarray:
            return np.frombuffer(m, dtype=np.uint32, count=count, offset=int(offset))

        self._sq_mask = int(u32(sq_map, sq["ring_mask"])[0])
        # Identity SQ array: SQE slot i is entry i, so the tail alone says what to submit.
        u32(sq_map, sq["array"], self.sq_entries)[:] = np.arange(self.sq_entries, dtype=np.uint32)
        self._sqes = np.frombuffer(sqe_map, dtype=np.uint64, count=self.sq_entries * 8).reshape(-1, 8)
        self._cq_mask = int(u32(cq_map, cq["ring_mask"])[0])
        self._cqes = np.frombuffer(cq_map, dtype=np.uint64, count=self.cq_entries * 2,
                                   offset=int(cq["cqes"])).reshape(-1, 2)  # rows of CQE_DTYPE
        self._tail = self._sq_tail.view[0]
        self._staged = 0
        self._wait_failures = 0  # transient failures of waits in a row
        self._sys = libc_syscall()
        # The wait's timeout: struct io_uring_getevents_arg {sigmask, sigmask_sz + pad, ts}
        # pointing at a struct __kernel_timespec; used where the kernel has EXT_ARG.
        self._ext_arg = bool(self.features & IORING_FEAT_EXT_ARG)
        self._timespec = np.zeros(2, dtype=np.int64)
        self._getevents_arg = np.zeros(3, dtype=np.uint64)
        self._getevents_arg[2] = self._timespec.ctypes.data
        self._getevents_address = int(self._getevents_arg.ctypes.data)
        self._timeout = -1.0  # what the timespec holds now
        # On TSO machines acquire/release are the plain accesses: read the views directly.
        self._plain = compiled is None
        self._cq_head_view = self._cq_head.view
        self._cq_tail_view = self._cq_tail.view

    def _map(self, size: int, offset: int) -> mmap.mmap:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        m = mmap.mmap(self.fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        self._maps.append(m)
        return m

    def _prepare(self, fd: int, offsets: np.ndarray, addrs: np.ndarray, lengths: np.ndarray,
                 user_data: np.ndarray) -> np.ndarray:
        """[k, 8] uint64: k SQEs (IORING_OP_READ), built with one vectorised pass per field."""
        sqes = np.zeros(len(lengths), dtype=SQE_DTYPE)
        sqes["opcode"] = IORING_OP_READ
        sqes["fd"] = fd
        sqes["off"] = offsets
        sqes["addr"] = addrs
        sqes["len"] = lengths
        sqes["user_data"] = user_data
        return sqes.view(np.uint64).reshape(-1, 8)  # plain rows copy ~10x faster than records

    def _issue(self, requests: np.ndarray, start: int, stop: int) -> None:
        k = stop - start
        slot = self._tail & self._sq_mask
        first = min(k, self.sq_entries - slot)
        self._sqes[slot: slot + first] = requests[start: start + first]
        if first < k:  # the ring wraps
            self._sqes[: k - first] = requests[start + first: stop]
        self._tail = (self._tail + k) & 0xFFFFFFFF
        # A plain store, as liburing without SQPOLL: the kernel reads it in our next
        # io_uring_enter, on this thread, after the SQE stores above.
        self._sq_tail.view[0] = self._tail
        self._staged += k

    def _exchange(self, min_complete: int, timeout: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        reaped: list[tuple[np.ndarray, np.ndarray]] = []
        waited = min_complete == 0
        failures = 0
        while self._staged:
            staged = self._staged
            wait = 0 if waited else min_complete
            done = self._enter(staged, wait, IORING_ENTER_GETEVENTS if wait else 0, timeout if wait else None)
            if done > 0:
                self._staged -= done
                failures = 0
                waited = waited or done == staged  # a partial submission returns without waiting
                continue
            err = -done if done < 0 else errno.EAGAIN  # 0: the kernel took nothing
            if err == errno.ETIME:  # the wait timed out after a submission of none: ask again
                err = errno.EAGAIN
            if err in TRANSIENT_ERRNOS and failures < self.limits.max_retries:
                failures += 1
                reaped.append(self._reap())  # make room (EBUSY: completions not yet reaped)
                if err != errno.EINTR:
                    self.limits.pause(failures)
                continue
            reaped.append(self._withdraw(err))
        got = sum(len(u) for u, _ in reaped) if reaped else 0
        if not waited and min_complete > got:
            ret = self._enter(0, min_complete - got, IORING_ENTER_GETEVENTS, timeout)
            if ret >= 0 or -ret == errno.ETIME:
                self._wait_failures = 0
            elif -ret in TRANSIENT_ERRNOS:
                # Nothing waited for: the caller comes back (its time limit, not a count, bounds it).
                self._wait_failures += 1
                if -ret != errno.EINTR:
                    self.limits.pause(self._wait_failures)
            else:
                raise QueueBroken(-ret, f"io_uring_enter cannot wait for completions: {os.strerror(-ret)}")
        reaped.append(self._reap())
        if len(reaped) == 1:
            return reaped[0]
        return np.concatenate([u for u, _ in reaped]), np.concatenate([r for _, r in reaped])

    def _enter(self, to_submit: int, min_complete: int, flags: int, timeout: float | None = None) -> int:
        """`io_uring_enter` inlined (the hot path: one call per refill): its result, or -errno."""
        faults = current_faults()
        if faults is not None:
            err = faults.syscall("io_uring_enter")
            if err:
                return -err
        if timeout is not None and min_complete and self._ext_arg:
            if timeout != self._timeout:  # the same limit wait after wait: set it once
                seconds = int(timeout)
                self._timespec[0] = seconds
                self._timespec[1] = int((timeout - seconds) * 1e9)
                self._timeout = timeout
            ret = self._sys(NR_ENTER, self.fd, to_submit, min_complete, flags | IORING_ENTER_EXT_ARG,
                            self._getevents_address, 24)
        else:
            ret = self._sys(NR_ENTER, self.fd, to_submit, min_complete, flags, 0, 8)
        return int(ret) if ret >= 0 else -ctypes.get_errno()

    def _withdraw(self, err: int) -> tuple[np.ndarray, np.ndarray]:
        """Take back the SQEs the kernel has not consumed (their reads fail with `err`)."""
        head = self._sq_head.view[0]  # READ_ONCE: without SQPOLL the kernel moves it only in our calls
        n = (self._tail - head) & 0xFFFFFFFF
        slots = (head + np.arange(n, dtype=np.int64)) & self._sq_mask
        user_data = self._sqes[slots, 4].copy()  # user_data is the SQE's fifth u64
        self._tail = head
        self._sq_tail.view[0] = head
        self._staged = 0
        own = (user_data >> np.uint64(32)) == 0
        if own.any():  # a cancel request that never went out
            self._internal -= int(np.count_nonzero(own))
            user_data = user_data[~own]
        return user_data, np.full(len(user_data), -(err + WITHDRAWN), dtype=np.int64)

    def _reap(self) -> tuple[np.ndarray, np.ndarray]:
        # Acquire: the CQEs up to the tail are written before we read them.
        tail = self._cq_tail_view[0] if self._plain else self._cq_tail.load_acquire()
        head = self._cq_head_view[0]  # ours: the kernel never writes it
        n = (tail - head) & 0xFFFFFFFF
        if not n:
            return _EMPTY_U64, _EMPTY_I32
        start = head & self._cq_mask
        if start + n <= self.cq_entries:
            cqes = self._cqes[start: start + n].copy()
        else:
            cqes = np.concatenate([self._cqes[start:], self._cqes[: start + n - self.cq_entries]])
        # Release, after the copy: the slots are the kernel's again.
        if self._plain:
            self._cq_head_view[0] = (head + n) & 0xFFFFFFFF
        else:
            self._cq_head.store_release((head + n) & 0xFFFFFFFF)
        # [n, 2] uint64 rows: user_data, then res (s32) and flags (u32)
        return cqes[:, 0], cqes.view(np.int32)[:, 2]

    def _cancel_in_flight(self) -> bool:
        """One IORING_OP_ASYNC_CANCEL for every request of the ring (its own CQE has sid 0)."""
        if self._staged >= self.sq_entries:
            return False
        sqe = np.zeros(1, dtype=SQE_DTYPE)
        sqe["opcode"] = IORING_OP_ASYNC_CANCEL
        sqe["fd"] = -1
        sqe["rw_flags"] = IORING_ASYNC_CANCEL_ANY
        sqe["user_data"] = 0
        self._issue(sqe.view(np.uint64).reshape(-1, 8), 0, 1)
        self._internal += 1
        return True

    def _release(self) -> None:
        # Drop the numpy views first: an mmap with exported buffers refuses to close.
        for name in ("_sqes", "_cqes", "_sq_head", "_sq_tail", "_cq_head", "_cq_tail", "_cq_head_view",
                     "_cq_tail_view"):
            self.__dict__.pop(name, None)
        for word in self.__dict__.pop("_words", []):
            word.view.release()
            word.load_acquire = word.store_release = None  # type: ignore[assignment]
        for m in getattr(self, "_maps", []):
            try:
                m.close()
            except BufferError:  # a view escaped; the mapping goes when it does
                pass
        self._maps = []
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1


_EMPTY_U64 = np.zeros(0, dtype=np.uint64)
_EMPTY_I32 = np.zeros(0, dtype=np.int32)


def _read_supported(fd: int) -> bool | None:
    """IORING_REGISTER_PROBE: does this kernel know IORING_OP_READ? None if it cannot say."""
    probe = np.zeros(16 + 256 * 8, dtype=np.uint8)  # struct io_uring_probe + 256 io_uring_probe_op
    try:
        syscall(NR_REGISTER, fd, IORING_REGISTER_PROBE, probe.ctypes.data, 256)
    except OSError:
        return None
    last_op = int(probe[0])
    op_flags = probe[16:].view(np.uint16).reshape(256, 4)[:, 1]  # {u8 op, u8 resv, u16 flags, u32 resv2}
    return last_op >= IORING_OP_READ and bool(op_flags[IORING_OP_READ] & IO_URING_OP_SUPPORTED)


def _refusal(exc: OSError) -> str:
    what = f"io_uring_setup refused: {exc.strerror} ({errno.errorcode.get(exc.errno or 0, exc.errno)})"
    if exc.errno == errno.ENOSYS:
        return what + "; the kernel has no io_uring, or a seccomp profile hides it"
    if exc.errno in (errno.EPERM, errno.EACCES):
        try:
            with open("/proc/sys/kernel/io_uring_disabled") as f:
                disabled = f.read().strip()
        except OSError:
            disabled = "0"
        if disabled not in ("", "0"):
            return what + f"; sysctl kernel.io_uring_disabled={disabled}"
        return what + "; probably a seccomp profile (Docker's and containerd's defaults refuse io_uring)"
    return what


@functools.lru_cache(maxsize=1)
def probe() -> str | None:
    """Why io_uring cannot run here, or None; tried once per process (clear with cache_clear)."""
    if not sys.platform.startswith("linux"):
        return "io_uring is Linux only"
    if platform.machine().lower() not in ARCHES:
        return f"no io_uring syscall numbers for {platform.machine()!r} (known: x86_64, aarch64)"
    try:
        fd = io_uring_setup(2, np.zeros(1, dtype=PARAMS_DTYPE))
    except OSError as exc:
        return _refusal(exc)
    try:
        if _read_supported(fd) is False:
            return "the kernel lacks IORING_OP_READ (Linux 5.6 or later needed)"
    finally:
        os.close(fd)
    access, why = ring_index_access(platform.machine())
    if access is None:
        return why
    # A real read through the rings, so every part the engine uses is known to work.
    try:
        ring = _Ring(2, atomics=access)
    except OSError as exc:
        return _refusal(exc)
    return probe_read(ring, "io_uring")


class UringEngine(NativeEngine):
    """io_uring: one ring per submitting thread, `depth` reads in flight per ring.

    atomics: "auto" (plain ring-index accesses on x86-64, the compiled helper elsewhere) or
    "compiled" (the helper everywhere: how other architectures run, testable here).
    """

    name = "io_uring"

    def __init__(self, depth: int = 64, limits: IoLimits | None = None, atomics: str = "auto",
                 **options: Any) -> None:
        if atomics not in ("auto", "compiled"):
            raise InvalidParameterError(f"atomics must be 'auto' or 'compiled', got {atomics!r}")
        super().__init__(depth, limits, **options)
        access, why = ring_index_access(platform.machine(), atomics)
        if access is None:
            raise EngineUnavailable(why)
        self.atomics = access

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return probe()

    def _new_queue(self) -> KernelQueue:
        return _Ring(self.depth, self.limits, self.atomics)
