"""io_uring's kernel interface as numpy sees it: syscall numbers, flags, the structs
(`SQE_DTYPE`, `CQE_DTYPE`, `PARAMS_DTYPE`) and the raw syscalls through libc. Used by the
io_uring engine (`uring.py`) and, for the syscall wrapper, the AIO engine."""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import numpy as np

__all__ = ["SQE_DTYPE", "CQE_DTYPE", "PARAMS_DTYPE", "io_uring_setup", "io_uring_enter", "syscall", "libc_syscall",
           "round_up_pow2"]

# Syscall numbers: the generic table, the same on x86_64 and aarch64.
NR_SETUP, NR_ENTER, NR_REGISTER = 425, 426, 427
ARCHES = {"x86_64", "amd64", "aarch64", "arm64"}

IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000
IORING_OP_ASYNC_CANCEL = 14
IORING_OP_READ = 22  # Linux 5.6
IORING_ENTER_GETEVENTS = 1
IORING_ENTER_EXT_ARG = 1 << 3  # 5.11: a timeout for the wait
IORING_FEAT_SINGLE_MMAP = 1
IORING_FEAT_EXT_ARG = 1 << 8
IORING_ASYNC_CANCEL_ANY = 1 << 2  # 5.19: cancel every request of the ring
IORING_REGISTER_PROBE = 8
IO_URING_OP_SUPPORTED = 1
IORING_SETUP_SUBMIT_ALL = 1 << 7  # 5.18: do not stop the batch at a request that fails to prepare
IORING_SETUP_COOP_TASKRUN = 1 << 8  # 5.19: no IPI to interrupt us for completions
IORING_SETUP_SINGLE_ISSUER = 1 << 12  # 6.0: one thread submits (ours do)
IORING_SETUP_DEFER_TASKRUN = 1 << 13  # 6.1: completions are posted when we ask, on our thread
#: Setup flags, best first; a kernel that does not know one answers EINVAL.
SETUP_FLAGS = (
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
if (PARAMS_DTYPE.itemsize, SQE_DTYPE.itemsize, CQE_DTYPE.itemsize) != (120, 64, 16):
    raise ImportError("io_uring struct layouts are not the kernel's 120 / 64 / 16 bytes")


@functools.lru_cache(maxsize=None)
def libc_syscall() -> Any:
    """libc's syscall(2), seven long arguments (extra ones are ignored by the kernel)."""
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long] * 7
    return fn


def syscall(nr: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0, e: int = 0, f: int = 0) -> int:
    """The raw syscall; OSError with its errno on failure (the GIL is released meanwhile)."""
    ret = libc_syscall()(nr, a, b, c, d, e, f)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ret)


def io_uring_setup(entries: int, params: np.ndarray) -> int:
    """A new ring's fd; `params` ([1] PARAMS_DTYPE) is read and filled in by the kernel."""
    return syscall(NR_SETUP, entries, params.ctypes.data)


def io_uring_enter(fd: int, to_submit: int, min_complete: int, flags: int) -> int:
    """Submit `to_submit` SQEs and (with GETEVENTS) wait for `min_complete` CQEs; retries EINTR."""
    while True:
        try:
            return syscall(NR_ENTER, fd, to_submit, min_complete, flags, 0, 8)
        except InterruptedError:
            continue  # only returned when nothing was submitted: the call can be repeated


def round_up_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
