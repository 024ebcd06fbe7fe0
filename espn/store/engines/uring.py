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
per read is the kernel's (virtio submission and completion), which fio pays too; the
issue's 2 us target holds for the engine's own (user-space) share only.

One ring per submitting thread (`threading.local`), made on the thread's first `submit`
and released by `close()`: with IORING_SETUP_SINGLE_ISSUER and DEFER_TASKRUN (kernel 6.1+)
only that thread may submit and reap, so `wait()` must run on the submitting thread
(the reader's contract already says so). Rings are made with SQ entries = depth rounded
up to a power of two and the kernel's default CQ of twice that; at most `depth` reads are
in flight per ring, so the CQ never overflows; larger submissions are handed over in
slices as completions free slots.

Memory ordering. Submission side: we write the SQEs, then the SQ tail (a numpy uint32
store into the mapping), then call `io_uring_enter` on the same thread; without SQPOLL
the kernel reads the tail and consumes the SQEs inside that syscall, in program order
after our stores, so no barrier is needed (a thread that migrates between CPUs passes
through the scheduler's full barriers). The kernel copies what it needs from each SQE at
submission, so the slots may be rewritten once `io_uring_enter` has returned.
Completion side: with DEFER_TASKRUN every CQE, and the CQ tail after it, is written by
our own thread inside `io_uring_enter(GETEVENTS)`, so reading the tail and then the CQEs
afterwards is ordered by program order on any architecture. On older kernels without
DEFER_TASKRUN, O_DIRECT completions are still posted from our task's task_work, but a
request the kernel punts to its io-wq workers completes from another CPU: x86's TSO
keeps our load of the tail before our loads of the CQEs; on ARM64 (weak ordering) that
case has no acquire barrier from Python, a known caveat for kernels before 6.1 only.
Advancing the CQ head needs no barrier either: we never have more than depth reads in
flight and the CQ holds twice that, so the kernel cannot reuse a slot we have just read
before we have reaped again.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import platform
import sys
from typing import Any

import numpy as np

from .native import KernelQueue, NativeEngine, probe_read

__all__ = ["UringEngine", "SQE_DTYPE", "CQE_DTYPE", "PARAMS_DTYPE", "io_uring_setup", "io_uring_enter"]

# Syscall numbers: the generic table, the same on x86_64 and aarch64.
_NR_SETUP, _NR_ENTER, _NR_REGISTER = 425, 426, 427
_ARCHES = {"x86_64", "amd64", "aarch64", "arm64"}

IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000
IORING_OP_READ = 22  # Linux 5.6
IORING_ENTER_GETEVENTS = 1
IORING_FEAT_SINGLE_MMAP = 1
IORING_REGISTER_PROBE = 8
IO_URING_OP_SUPPORTED = 1
IORING_SETUP_SUBMIT_ALL = 1 << 7  # 5.18: do not stop the batch at a request that fails to prepare
IORING_SETUP_COOP_TASKRUN = 1 << 8  # 5.19: no IPI to interrupt us for completions
IORING_SETUP_SINGLE_ISSUER = 1 << 12  # 6.0: one thread submits (ours do)
IORING_SETUP_DEFER_TASKRUN = 1 << 13  # 6.1: completions are posted when we ask, on our thread
#: Setup flags, best first; a kernel that does not know one answers EINVAL.
_SETUP_FLAGS = (
    IORING_SETUP_SUBMIT_ALL | IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
    IORING_SETUP_SUBMIT_ALL | IORING_SETUP_COOP_TASKRUN,
    0,
)

_u1, _u2, _u4, _u8, _i4 = np.uint8, np.uint16, np.uint32, np.uint64, np.int32
_SQ_OFFSETS = np.dtype([("head", _u4), ("tail", _u4), ("ring_mask", _u4), ("ring_entries", _u4), ("flags", _u4),
                        ("dropped", _u4), ("array", _u4), ("resv1", _u4), ("user_addr", _u8)])
_CQ_OFFSETS = np.dtype([("head", _u4), ("tail", _u4), ("ring_mask", _u4), ("ring_entries", _u4), ("overflow", _u4),
                        ("cqes", _u4), ("flags", _u4), ("resv1", _u4), ("user_addr", _u8)])
#: struct io_uring_params (120 bytes)
PARAMS_DTYPE = np.dtype([("sq_entries", _u4), ("cq_entries", _u4), ("flags", _u4), ("sq_thread_cpu", _u4),
                         ("sq_thread_idle", _u4), ("features", _u4), ("wq_fd", _u4), ("resv", _u4, (3,)),
                         ("sq_off", _SQ_OFFSETS), ("cq_off", _CQ_OFFSETS)])
#: struct io_uring_sqe (64 bytes)
SQE_DTYPE = np.dtype([("opcode", _u1), ("flags", _u1), ("ioprio", _u2), ("fd", _i4), ("off", _u8), ("addr", _u8),
                      ("len", _u4), ("rw_flags", _u4), ("user_data", _u8), ("buf_index", _u2), ("personality", _u2),
                      ("splice_fd_in", _i4), ("addr3", _u8), ("pad2", _u8)])
#: struct io_uring_cqe (16 bytes; rings without IORING_SETUP_CQE32)
CQE_DTYPE = np.dtype([("user_data", _u8), ("res", _i4), ("flags", _u4)])
assert PARAMS_DTYPE.itemsize == 120 and SQE_DTYPE.itemsize == 64 and CQE_DTYPE.itemsize == 16


@functools.lru_cache(maxsize=None)
def _libc_syscall() -> Any:
    """libc's syscall(2), seven long arguments (extra ones are ignored by the kernel)."""
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long] * 7
    return fn


def _syscall(nr: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0, e: int = 0, f: int = 0) -> int:
    """The raw syscall; OSError with its errno on failure (the GIL is released meanwhile)."""
    ret = _libc_syscall()(nr, a, b, c, d, e, f)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


def io_uring_setup(entries: int, params: np.ndarray) -> int:
    """A new ring's fd; `params` ([1] PARAMS_DTYPE) is read and filled in by the kernel."""
    return _syscall(_NR_SETUP, entries, params.ctypes.data)


def io_uring_enter(fd: int, to_submit: int, min_complete: int, flags: int) -> int:
    """Submit `to_submit` SQEs and (with GETEVENTS) wait for `min_complete` CQEs; retries EINTR."""
    while True:
        try:
            return _syscall(_NR_ENTER, fd, to_submit, min_complete, flags, 0, 8)
        except InterruptedError:
            continue  # only returned when nothing was submitted: the call can be repeated


def _round_up_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _Ring(KernelQueue):
    """One io_uring instance: SQ, CQ and SQE array mapped and viewed through numpy."""

    def __init__(self, capacity: int) -> None:
        entries = _round_up_pow2(max(capacity, 2))
        params = np.zeros(1, dtype=PARAMS_DTYPE)
        for flags in _SETUP_FLAGS:
            params[:] = 0
            params["flags"] = flags
            try:
                fd = io_uring_setup(entries, params)
                break
            except OSError as exc:
                if exc.errno != errno.EINVAL or flags == _SETUP_FLAGS[-1]:
                    raise
        super().__init__(min(capacity, entries))
        self.fd = fd
        self.setup_flags = int(params["flags"][0])
        os.set_inheritable(fd, False)  # the kernel makes it O_CLOEXEC already; say so anyway
        p = params[0]
        sq, cq = p["sq_off"], p["cq_off"]
        self.sq_entries, self.cq_entries = int(p["sq_entries"]), int(p["cq_entries"])
        sq_size = int(sq["array"]) + self.sq_entries * 4
        cq_size = int(cq["cqes"]) + self.cq_entries * CQE_DTYPE.itemsize
        single = bool(int(p["features"]) & IORING_FEAT_SINGLE_MMAP)
        if single:
            sq_size = cq_size = max(sq_size, cq_size)
        self._maps: list[mmap.mmap] = []
        try:
            sq_map = self._map(sq_size, IORING_OFF_SQ_RING)
            cq_map = sq_map if single else self._map(cq_size, IORING_OFF_CQ_RING)
            sqe_map = self._map(self.sq_entries * SQE_DTYPE.itemsize, IORING_OFF_SQES)
        except BaseException:
            self._release()
            raise

        def u32(m: mmap.mmap, offset: Any, count: int = 1) -> np.ndarray:
            return np.frombuffer(m, dtype=np.uint32, count=count, offset=int(offset))

        def word(m: mmap.mmap, offset: Any) -> memoryview:  # one u32 as a Python int: faster than numpy scalars
            view = memoryview(m)[int(offset): int(offset) + 4].cast("I")
            self._words.append(view)
            return view

        self._words: list[memoryview] = []
        self._sq_tail = word(sq_map, sq["tail"])
        self._sq_mask = int(u32(sq_map, sq["ring_mask"])[0])
        # Identity SQ array: SQE slot i is entry i, so the tail alone says what to submit.
        u32(sq_map, sq["array"], self.sq_entries)[:] = np.arange(self.sq_entries, dtype=np.uint32)
        self._sqes = np.frombuffer(sqe_map, dtype=np.uint64, count=self.sq_entries * 8).reshape(-1, 8)
        self._cq_head = word(cq_map, cq["head"])
        self._cq_tail = word(cq_map, cq["tail"])
        self._cq_mask = int(u32(cq_map, cq["ring_mask"])[0])
        self._cqes = np.frombuffer(cq_map, dtype=np.uint64, count=self.cq_entries * 2,
                                   offset=int(cq["cqes"])).reshape(-1, 2)  # rows of CQE_DTYPE
        self._tail = int(self._sq_tail[0])
        self._staged = 0
        self._sys = _libc_syscall()

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
        self._sq_tail[0] = self._tail  # read by the kernel in our next io_uring_enter
        self._staged += k

    def _exchange(self, min_complete: int) -> tuple[np.ndarray, np.ndarray]:
        waited = min_complete == 0
        while self._staged:
            staged = self._staged
            wait = 0 if waited else min_complete
            done = self._enter(staged, wait, IORING_ENTER_GETEVENTS if wait else 0)
            if done == 0:
                raise OSError(errno.EAGAIN, "io_uring_enter accepted no request")
            self._staged -= done
            waited = waited or done == staged  # a partial submission returns without waiting
        if not waited:
            self._enter(0, min_complete, IORING_ENTER_GETEVENTS)
        return self._reap()

    def _enter(self, to_submit: int, min_complete: int, flags: int) -> int:
        """`io_uring_enter` inlined (the hot path: one call per refill); retries EINTR."""
        while True:
            ret = self._sys(_NR_ENTER, self.fd, to_submit, min_complete, flags, 0, 8)
            if ret >= 0:
                return int(ret)
            err = ctypes.get_errno()
            if err != errno.EINTR:  # EINTR comes only when nothing was submitted: repeat the call
                raise OSError(err, os.strerror(err))

    def _reap(self) -> tuple[np.ndarray, np.ndarray]:
        head = self._cq_head[0]
        n = (self._cq_tail[0] - head) & 0xFFFFFFFF
        if not n:
            return _EMPTY_U64, _EMPTY_I32
        start = head & self._cq_mask
        if start + n <= self.cq_entries:
            cqes = self._cqes[start: start + n].copy()
        else:
            cqes = np.concatenate([self._cqes[start:], self._cqes[: start + n - self.cq_entries]])
        self._cq_head[0] = (head + n) & 0xFFFFFFFF  # after the copy: the slots are ours until here
        # [n, 2] uint64 rows: user_data, then res (s32) and flags (u32)
        return cqes[:, 0], cqes.view(np.int32)[:, 2]

    def _release(self) -> None:
        # Drop the numpy views first: an mmap with exported buffers refuses to close.
        for name in ("_sq_tail", "_sqes", "_cq_head", "_cq_tail", "_cqes"):
            self.__dict__.pop(name, None)
        for view in self.__dict__.pop("_words", []):
            view.release()
        for m in self._maps:
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
        _syscall(_NR_REGISTER, fd, IORING_REGISTER_PROBE, probe.ctypes.data, 256)
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
    if platform.machine().lower() not in _ARCHES:
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
    # A real read through the rings, so every part the engine uses is known to work.
    try:
        ring = _Ring(2)
    except OSError as exc:
        return _refusal(exc)
    return probe_read(ring, "io_uring")


class UringEngine(NativeEngine):
    """io_uring: one ring per submitting thread, `depth` reads in flight per ring."""

    name = "io_uring"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return probe()

    def _new_queue(self) -> KernelQueue:
        return _Ring(self.depth)
