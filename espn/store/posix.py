"""The default reader without a GPU: `O_DIRECT` reads, all in flight at once, through a
native read engine.

`O_DIRECT` bypasses the page cache, so what a read costs is what the SSD costs (the
setting the paper measures), and RAM stays free for the ANN index. The records of one
call are planned into few aligned extents (`plan_extents`: adjacent blocks coalesced)
and handed to the read engine in one call (`espn.store.engines`: io_uring, then Linux
AIO, then a thread pool), which reads them into one page-aligned pooled buffer. `submit`
returns with the reads in flight, so the search goes on scanning while the SSD works;
the base class parses the buffer when the result is asked for.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InvalidParameterError
from .base import DEFAULT_MAX_EXTENT_BYTES, BufferPool, ExtentPlan, Fetch, Reader, plan_extents
from .engines import EngineRead, open_engine
from .engines.threads import read_fully
from .format import StoreLayout

__all__ = ["PosixReader", "DEFAULT_IO_DEPTH"]

logger = logging.getLogger(__name__)

#: Extents in flight at once (the engine's queue depth, or its threads).
DEFAULT_IO_DEPTH = 64

_warned_lock = threading.Lock()
_warned_no_direct = False


def _warn_no_direct(path: Path, reason: str) -> None:
    """Warn once per process; later readers log at debug level."""
    global _warned_no_direct
    with _warned_lock:
        first, _warned_no_direct = not _warned_no_direct, True
    log = logger.warning if first else logger.debug
    log(
        "O_DIRECT is not usable for %s (%s); falling back to buffered reads with "
        "POSIX_FADV_RANDOM: reads may be served from the page cache",
        path,
        reason,
    )


class _PosixFetch(Fetch):
    def __init__(self, reader: "PosixReader", plan: ExtentPlan, buf: mmap.mmap, fd: int, pending: EngineRead) -> None:
        self._reader = reader
        self._plan = plan
        self._buf = buf
        self._fd = fd
        self._pending = pending

    def complete(self) -> tuple[np.ndarray, np.ndarray, int, int]:
        plan, array = self._plan, np.frombuffer(self._buf, dtype=np.uint8, count=self._plan.nbytes)
        try:
            counts = self._pending.wait()
        except OSError as exc:
            if exc.errno != errno.EINVAL or self._fd != self._reader._fd_direct:
                raise
            # A filesystem that took O_DIRECT at open but refuses this read: buffered from now on.
            self._reader._disable_direct(f"read: {exc.strerror}")
            counts = self._reader._engine.submit(self._reader._fd_buffered, plan.file_offsets, plan.lengths, array,
                                                 plan.buffer_offsets).wait()
        short = np.flatnonzero(counts < plan.lengths)
        for i in short.tolist():  # only at the end of an unpadded file
            at, end = int(plan.buffer_offsets[i] + counts[i]), int(plan.buffer_offsets[i] + plan.lengths[i])
            array[at:end] = 0
        return array, plan.starts, plan.nbytes, len(plan)

    def release(self) -> None:
        self._reader._pool.release(self._buf)


class PosixReader(Reader):
    """`O_DIRECT` reads of coalesced, block-aligned extents through a read engine.

    Options:
      io_engine:        "io_uring", "aio", "threads", or None / "auto" (the best this host allows)
      io_depth:         extents in flight at once (default 64; threads for the threads engine)
      max_extent_bytes: cap on one coalesced request (default 1 MiB, rounded to blocks)
      direct:           try `O_DIRECT` (default True); False forces buffered reads

    `self.engine` names the engine in use; `self.direct` says whether `O_DIRECT` is in use:
    filesystems that refuse it (tmpfs on older kernels, some FUSE and network
    filesystems) get buffered reads with `POSIX_FADV_RANDOM` and one warning.
    bytes_read = sum of extent sizes, ios = extents.
    """

    name = "posix"

    def __init__(
        self,
        path: Path,
        records: np.ndarray,
        layout: StoreLayout,
        device: str | torch.device = "cpu",
        *,
        io_engine: str | None = None,
        io_depth: int = DEFAULT_IO_DEPTH,
        max_extent_bytes: int = DEFAULT_MAX_EXTENT_BYTES,
        direct: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(path, records, layout, device, **options)
        if isinstance(max_extent_bytes, bool) or not isinstance(max_extent_bytes, int) or max_extent_bytes < 1:
            raise InvalidParameterError(f"max_extent_bytes must be a positive integer, got {max_extent_bytes!r}")
        if not isinstance(direct, bool):
            raise InvalidParameterError(f"direct must be true or false, got {direct!r}")
        self.io_depth = io_depth
        self.max_extent_bytes = max(layout.block_size, max_extent_bytes - max_extent_bytes % layout.block_size)
        self._engine = open_engine(io_engine, io_depth)
        self._pool = BufferPool()
        # The buffered descriptor serves the fallback where O_DIRECT is refused.
        self._fd_buffered = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._fd_direct: int | None = None
        self.direct = False
        if direct:
            self._open_direct()
        if not self.direct:
            self._advise_random()

    @property
    def engine(self) -> str:
        """The read engine in use: "io_uring", "aio" or "threads"."""
        return self._engine.name

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "io_depth": self.io_depth, "direct": self.direct,
                "max_extent_bytes": self.max_extent_bytes}

    # -- setup ----------------------------------------------------------------------------

    def _open_direct(self) -> None:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            _warn_no_direct(self.path, "this platform has no O_DIRECT")
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            _warn_no_direct(self.path, f"open: {exc.strerror}")
            return
        # Some filesystems accept the flag at open and refuse the read (or refuse this
        # block size, when the device's logical block is larger): probe one block.
        if self.file_size:
            probe = mmap.mmap(-1, self.layout.block_size)
            try:
                read_fully(fd, memoryview(probe), 0)
            except OSError as exc:
                os.close(fd)
                if exc.errno != errno.EINVAL:
                    raise
                _warn_no_direct(self.path, f"read: {exc.strerror}")
                return
            finally:
                probe.close()
        self._fd_direct = fd
        self.direct = True

    def _advise_random(self) -> None:
        # No readahead: each request is one record's blocks, neighbours are not wanted.
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd_buffered, 0, 0, os.POSIX_FADV_RANDOM)

    def _disable_direct(self, reason: str) -> None:
        if self.direct:
            self.direct = False
            self._advise_random()
            _warn_no_direct(self.path, reason)

    # -- reading --------------------------------------------------------------------------

    def _submit(self, offsets: np.ndarray, lengths: np.ndarray) -> Fetch:
        plan = plan_extents(offsets, lengths, self.layout.block_size, self.max_extent_bytes)
        buf = self._pool.acquire(plan.nbytes)
        array = np.frombuffer(buf, dtype=np.uint8)
        fd = self._fd_direct if self.direct and self._fd_direct is not None else self._fd_buffered
        try:
            pending = self._engine.submit(fd, plan.file_offsets, plan.lengths, array, plan.buffer_offsets)
        except BaseException:
            self._pool.release(buf)
            raise
        return _PosixFetch(self, plan, buf, fd, pending)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._engine.close()
        self._pool.clear()
        for fd in (self._fd_direct, self._fd_buffered):
            if fd is not None:
                os.close(fd)
        self._fd_direct = None
