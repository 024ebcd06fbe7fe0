"""Every `.npy` espn reads: memory-mapped holding no file descriptor, or read whole; headers under one lock.

`np.load(mmap_mode="r")` maps through Python's `mmap.mmap`, which keeps a duplicate of
the file's descriptor open for as long as the array lives. An index maps several arrays
per segment and per metadata field, and a live index maps them again for every
generation a worker holds, so descriptors would grow with the number of writes and of
metadata fields (a `ulimit -n 1024` server ran out after about a hundred writes).
Here the descriptor is closed as soon as the mapping exists: `mmap(trackfd=False)` on
Python 3.13+, otherwise `mmap(2)` through ctypes with `munmap(2)` run when the last
array viewing the mapping is garbage-collected. Pages are shared with every other
process mapping the file, exactly as with `np.load(mmap_mode="r")`.

Every `.npy` header espn reads is parsed here, under one lock (`read_npy` for a whole array):
numpy parses a header with `ast.literal_eval`, and CPython 3.11 keeps the AST builder's
recursion count per interpreter, not per thread, so two threads parsing at once can fail with
"SystemError: AST constructor recursion depth mismatch" (cpython gh-106905). A server parses
headers in several threads at once (a generation opened beside a search, a snapshot verified
beside a write); the lock costs microseconds per file opened.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["map_npy", "read_npy"]

_PROT_READ, _MAP_SHARED = mmap.PROT_READ, mmap.MAP_SHARED


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


_LIBC: Any = None


def _map_readonly(fd: int, size: int) -> Any:
    """A read-only shared mapping of the first `size` bytes of `fd` that does not keep `fd` open."""
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ, trackfd=False)  # type: ignore[call-arg]
    global _LIBC
    if _LIBC is None:
        _LIBC = _libc()
    address = _LIBC.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    buffer = (ctypes.c_char * size).from_address(address)
    weakref.finalize(buffer, _LIBC.munmap, address, size)  # when the last view of it is gone
    return buffer


_HEADER_LOCK = threading.Lock()


def _header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, Fortran order, dtype, data offset) of the `.npy` file `f`, parsed under the lock."""
    with _HEADER_LOCK:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    return shape, fortran, dtype, f.tell()


def _plain_header(f: Any, path: Path | str) -> tuple[tuple[int, ...], bool, np.dtype, int, int]:
    """_header, checked: not an object array (never unpickled), and the file holds every byte the
    header describes; adds the element count."""
    shape, fortran, dtype, offset = _header(f)
    if dtype.hasobject:
        raise ValueError(f"{path}: an object array (espn reads plain arrays only, never pickles)")
    count = int(np.prod(shape, dtype=np.int64))
    size = os.fstat(f.fileno()).st_size
    if offset + count * dtype.itemsize > size:
        raise ValueError(f"{path}: {size} bytes, the header describes {offset + count * dtype.itemsize}")
    return shape, fortran, dtype, offset, count


def read_npy(path: Path | str) -> np.ndarray:
    """The array of a `.npy` file read whole into memory (writable; no descriptor kept), as
    `np.load(path, allow_pickle=False)` with its header parsed under the lock.

    Raises ValueError for an object array or a file shorter than its header says, OSError
    when it cannot be read."""
    with open(path, "rb") as f:
        shape, fortran, dtype, _, count = _plain_header(f, path)
        array = np.fromfile(f, dtype=dtype, count=count)
    return array.reshape(shape, order="F" if fortran else "C")


def map_npy(path: Path | str) -> np.ndarray:
    """The array of a `.npy` file, read-only and memory-mapped, holding no descriptor.

    Raises ValueError for a file that is not a plain (non-object) `.npy` array and
    OSError when it cannot be read; an empty array is returned as a small in-memory one.
    """
    with open(path, "rb") as f:
        shape, fortran, dtype, offset, count = _plain_header(f, path)
        nbytes = count * dtype.itemsize
        if nbytes == 0:
            return np.zeros(shape, dtype=dtype)
        buffer = _map_readonly(f.fileno(), offset + nbytes)
    array = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
    array = array.reshape(shape, order="F" if fortran else "C")
    array.flags.writeable = False  # the pages are mapped read-only: a write would fault
    return array
