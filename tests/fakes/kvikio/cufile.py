"""kvikio.cufile of 26.10: `CuFile` and `IOFuture`, reading with plain POSIX `pread`.

A torch tensor passed as `buf` stands in for device (GPU) memory; anything else must be a
writable host buffer (numpy array, memoryview).
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import threading
from typing import Any, Optional, Union

import numpy as np
import torch

from ._system import _fake


class _Done:
    """The handle of a future that is finished at creation (kvikio's small-read shortcut)."""

    def __init__(self, value: int) -> None:
        self._value = value

    def get(self) -> int:
        return self._value

    def done(self) -> bool:
        return True


class _Tasks:
    """The handle of a read split into pool tasks: get() returns the sum, or raises the
    first error in task order (as libkvikio's gather of task futures does)."""

    def __init__(self, futures: list[concurrent.futures.Future[int]], file_offset: int) -> None:
        self._futures = futures
        self._file_offset = file_offset

    def get(self) -> int:
        _fake.log("get", self._file_offset, threading.current_thread().name)
        return sum(f.result() for f in self._futures)

    def done(self) -> bool:
        return all(f.done() for f in self._futures)


class IOFuture:
    """Future for CuFile IO"""

    __slots__ = "_handle"

    def __init__(self, handle):  # type: ignore[no-untyped-def]
        self._handle = handle

    def get(self) -> int:
        return self._handle.get()

    def done(self) -> bool:
        return self._handle.done()


def _host_view(buf: Any) -> tuple[np.ndarray, bool]:
    """(uint8 numpy view of buf, True when buf stands in for device memory)."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("the fake reads into contiguous CPU tensors standing in for device memory")
        return buf.view(torch.uint8).numpy(), True
    array = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.view(np.uint8).reshape(-1)
    if not array.flags.writeable:
        raise ValueError("buffer is read-only")
    return array, False


class CuFile:
    """File handle for GPUDirect Storage (GDS)"""

    def __init__(self, file: Union[pathlib.Path, str], flags: str = "r"):
        if flags != "r":
            raise NotImplementedError("the fake only reads")
        self._path = pathlib.Path(file)
        self._fd: int | None = os.open(self._path, os.O_RDONLY)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def closed(self) -> bool:
        return self._fd is None

    def fileno(self) -> int:
        if self._fd is None:
            raise RuntimeError("file is closed")
        return self._fd

    def open_flags(self) -> int:
        return os.O_RDONLY

    def __enter__(self) -> "CuFile":
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:  # type: ignore[no-untyped-def]
        self.close()

    def _read_task(self, array: np.ndarray, at: int, size: int, file_offset: int) -> int:
        with _fake.lock:
            _fake.in_flight += 1
            _fake.max_in_flight = max(_fake.max_in_flight, _fake.in_flight)
        try:
            error = _fake.fail.get(file_offset)
            if error is not None:  # fails at once, while the held ones are still in flight
                _fake.log("task", file_offset, size, threading.current_thread().name)
                raise error
            _fake.release.wait()
            _fake.log("task", file_offset, size, threading.current_thread().name)
            got = 0
            while got < size:
                data = os.pread(self.fileno(), size - got, file_offset + got)
                if not data:
                    raise RuntimeError("KvikIO failure at: posix_io.hpp:173: POSIX error on pread: EOF")
                array[at + got : at + got + len(data)] = np.frombuffer(data, dtype=np.uint8)
                got += len(data)
            return size
        finally:
            with _fake.lock:
                _fake.in_flight -= 1

    def pread(
        self,
        buf,
        size: Optional[int] = None,
        file_offset: int = 0,
        task_size: Optional[int] = None,
    ) -> IOFuture:
        """Reads specified bytes from the file into device or host memory in parallel"""
        array, device = _host_view(buf)
        size = array.nbytes if size is None else size
        if size > array.nbytes:
            raise ValueError(f"size {size} exceeds the buffer ({array.nbytes} bytes)")
        task_size = _fake.settings["task_size"] if task_size is None else task_size
        _fake.log("pread", file_offset, size, threading.current_thread().name)
        if device and size < _fake.settings["gds_threshold"]:
            # FileHandle::pread: "Shortcut that circumvent the threadpool and use the POSIX
            # backend directly", synchronously, then a ready future.
            _fake.log("shortcut", file_offset, size, threading.current_thread().name)
            return IOFuture(_Done(self._read_task(array, 0, size, file_offset)))
        starts = list(range(0, max(size, 1), max(task_size, 1)))
        futures = [
            _fake.submit(lambda s=s: self._read_task(array, s, min(task_size, size - s), file_offset + s))
            for s in starts
        ]
        return IOFuture(_Tasks(futures, file_offset))

    def read(
        self,
        buf,
        size: Optional[int] = None,
        file_offset: int = 0,
        task_size: Optional[int] = None,
    ) -> int:
        """Reads specified bytes from the file into the device memory in parallel"""
        return self.pread(buf, size, file_offset, task_size).get()

    def is_direct_io_supported(self) -> bool:
        return False
