"""The default reader without a GPU: `O_DIRECT` reads, all in flight at once, through a
native read engine.

`O_DIRECT` bypasses the page cache, so what a read costs is what the SSD costs (the
setting the paper measures), and RAM stays free for the ANN index. The records of one
call are planned into few aligned extents (`plan_extents`: adjacent blocks coalesced)
and handed to the read engine in one call (`espn.store.engines`: io_uring, then Linux
AIO, then a thread pool), which reads them into one page-aligned pooled buffer. `submit`
returns with the reads in flight, so the search goes on scanning while the SSD works;
the base class parses the buffer when the result is asked for.

Lifetimes (the ownership rule of `engines/base.py`): a fetch gives its buffer back to the
pool only once the engine says the read is drained; if it is not (a search abandoned
mid-flight), the fetch cancels and drains it first, and quarantines the buffer when that
is impossible (another thread, a stuck device). `close` refuses new reads, waits for
(or cancels and reaps) every read in flight on every thread, then closes the descriptors.
A filesystem that refuses `O_DIRECT` is found once, at open; a read that fails later
fails as itself (a `ReadError` naming the file, the offset and the errno).
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
from .buffers import BufferPool, process_pool
from .engines import EngineRead, IoLimits, StoreClosedError, open_engine
from .engines.threads import read_fully
from .extents import DEFAULT_MAX_EXTENT_BYTES, ExtentPlan, plan_extents
from .format import StoreLayout
from .pending import Fetch
from .reader import Reader

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
    def __init__(self, reader: "PosixReader", plan: ExtentPlan, buf: mmap.mmap, pending: EngineRead) -> None:
        self._reader = reader
        self._plan = plan
        self._buf: mmap.mmap | None = buf
        self._pending = pending

    def complete(self) -> tuple[np.ndarray, np.ndarray, int, int]:
        plan = self._plan
        if self._buf is None:
            raise ValueError("this read's buffer was already given back")
        array = np.frombuffer(self._buf, dtype=np.uint8, count=plan.nbytes)
        counts = self._pending.wait()
        short = np.flatnonzero(counts < plan.lengths)
        for i in short.tolist():  # only at the end of an unpadded file
            at, end = int(plan.buffer_offsets[i] + counts[i]), int(plan.buffer_offsets[i] + plan.lengths[i])
            array[at:end] = 0
        return array, plan.starts, plan.nbytes, len(plan)

    def cancel(self) -> None:
        self._pending.cancel()

    def release(self) -> None:
        buf, self._buf = self._buf, None
        if buf is None:
            return
        pending = self._pending
        try:
            if not pending.drained:  # abandoned mid-flight: drain it before the buffer goes back
                pending.cancel()
                try:
                    pending.wait()
                except Exception:  # noqa: BLE001 - its error was the caller's to see; only the drain matters here
                    pass
        finally:
            self._reader.buffer_pool.release(buf, in_flight=not pending.drained)


class PosixReader(Reader):
    """`O_DIRECT` reads of coalesced, block-aligned extents through a read engine.

    Options:
      io_engine:        "io_uring", "aio", "threads", or None / "auto" (the best this host allows)
      io_depth:         extents in flight at once (default 64; threads for the threads engine)
      max_extent_bytes: cap on one coalesced request (default 1 MiB, rounded to blocks)
      direct:           try `O_DIRECT` (default True); False forces buffered reads
      io_limits:        retries, backoff and time limits of the engine (`IoLimits`)

    `self.engine` names the engine in use; `self.direct` says whether `O_DIRECT` is in use:
    filesystems that refuse it (tmpfs on older kernels, some FUSE and network
    filesystems) get buffered reads with `POSIX_FADV_RANDOM` and one warning; that is
    decided once, at open. bytes_read = sum of extent sizes, ios = extents.
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
        io_limits: IoLimits | None = None,
        **options: Any,
    ) -> None:
        super().__init__(path, records, layout, device, **options)
        if isinstance(max_extent_bytes, bool) or not isinstance(max_extent_bytes, int) or max_extent_bytes < 1:
            raise InvalidParameterError(f"max_extent_bytes must be a positive integer, got {max_extent_bytes!r}")
        if not isinstance(direct, bool):
            raise InvalidParameterError(f"direct must be true or false, got {direct!r}")
        self.io_depth = io_depth
        self.max_extent_bytes = max(layout.block_size, max_extent_bytes - max_extent_bytes % layout.block_size)
        self._engine = open_engine(io_engine, io_depth, io_limits)
        self._pool = process_pool()
        self._close_lock = threading.Lock()
        self._fd: int | None = None
        self.direct = False
        try:
            if direct:
                self._fd = self._open_direct()
            if self._fd is None:  # the fallback where O_DIRECT is refused
                self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._advise_random()
        except BaseException:
            self._engine.close()
            raise

    @property
    def engine(self) -> str:
        """The read engine in use: "io_uring", "aio" or "threads"."""
        return self._engine.name

    @property
    def buffer_pool(self) -> BufferPool:
        """The pool of read buffers, the process's (its `stats()`; tests `check()` its canaries)."""
        return self._pool

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "io_depth": self.io_depth, "direct": self.direct,
                "max_extent_bytes": self.max_extent_bytes}

    # -- setup ----------------------------------------------------------------------------

    def _open_direct(self) -> int | None:
        """An O_DIRECT descriptor, or None where the filesystem refuses it (probed here, once)."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            _warn_no_direct(self.path, "this platform has no O_DIRECT")
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            _warn_no_direct(self.path, f"open: {exc.strerror}")
            return None
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
                return None
            finally:
                probe.close()
        self.direct = True
        return fd

    def _advise_random(self) -> None:
        # No readahead: each request is one record's blocks, neighbours are not wanted.
        if hasattr(os, "posix_fadvise") and self._fd is not None:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

    # -- reading --------------------------------------------------------------------------

    def _submit(self, offsets: np.ndarray, lengths: np.ndarray) -> Fetch:
        plan = plan_extents(offsets, lengths, self.layout.block_size, self.max_extent_bytes)
        fd = self._fd
        if fd is None:
            raise StoreClosedError(f"the posix reader of {self.path} is closed")
        buf = self._pool.acquire(plan.nbytes)
        try:
            pending = self._engine.submit(fd, plan.file_offsets, plan.lengths, np.frombuffer(buf, dtype=np.uint8),
                                          plan.buffer_offsets)
        except BaseException:
            # The engine drained what it started before raising; the ledger checks it.
            self._pool.release(buf, in_flight=True)
            raise
        return _PosixFetch(self, plan, buf, pending)

    def close(self) -> None:
        """Refuse new reads, wait for (or cancel and reap) every read in flight, then close."""
        with self._close_lock:
            if self.closed:
                return
            super().close()
        self._engine.close()  # every thread's reads drain before a ring goes
        fd, self._fd = self._fd, None
        if fd is not None:  # once no read is in flight: a queued one must not find the number reused
            self._engine.when_idle(lambda: os.close(fd))
