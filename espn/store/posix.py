"""The default reader without a GPU: parallel `O_DIRECT` reads with `os.preadv`.

`O_DIRECT` bypasses the page cache, so what a read costs is what the SSD costs (the
setting the paper measures), and RAM stays free for the ANN index. The records of one
call are planned into few aligned extents (`plan_extents`: adjacent blocks coalesced),
read into one page-aligned buffer by a thread pool (`os.preadv` releases the GIL, so
`io_threads` requests are in flight at once), then parsed by the base class.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import InvalidParameterError
from .base import DEFAULT_MAX_EXTENT_BYTES, ExtentPlan, Reader, plan_extents
from .format import StoreLayout

__all__ = ["PosixReader", "DEFAULT_IO_THREADS"]

logger = logging.getLogger(__name__)

DEFAULT_IO_THREADS = 16
#: Per-thread read buffers up to this size are kept for the next call (a fresh anonymous
#: mapping costs a page fault per 4 KiB); larger ones are one-off.
_REUSE_LIMIT = 4 << 20  # one query's read (100 SciFact docs ~4 MB, MS MARCO ~0.4 MB); batches are one-off

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


class PosixReader(Reader):
    """`O_DIRECT` reads of coalesced, block-aligned extents from a thread pool.

    Options:
      io_threads:       reads in flight at once (default 16)
      max_extent_bytes: cap on one coalesced request (default 1 MiB, rounded to blocks)
      direct:           try `O_DIRECT` (default True); False forces buffered reads

    `self.direct` says whether `O_DIRECT` is in use: filesystems that refuse it (tmpfs on
    older kernels, some FUSE and network filesystems) get buffered reads with
    `POSIX_FADV_RANDOM` and one warning. bytes_read = sum of extent sizes, ios = extents.
    """

    name = "posix"

    def __init__(
        self,
        path: Path,
        records: np.ndarray,
        layout: StoreLayout,
        device: str | torch.device = "cpu",
        *,
        io_threads: int = DEFAULT_IO_THREADS,
        max_extent_bytes: int = DEFAULT_MAX_EXTENT_BYTES,
        direct: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(path, records, layout, device, **options)
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or not 1 <= io_threads <= 1024:
            raise InvalidParameterError(f"io_threads must be an integer in [1, 1024], got {io_threads!r}")
        if isinstance(max_extent_bytes, bool) or not isinstance(max_extent_bytes, int) or max_extent_bytes < 1:
            raise InvalidParameterError(f"max_extent_bytes must be a positive integer, got {max_extent_bytes!r}")
        self.io_threads = io_threads
        self.max_extent_bytes = max(layout.block_size, max_extent_bytes - max_extent_bytes % layout.block_size)
        self._local = threading.local()
        # The buffered descriptor serves the fallback and the odd unaligned tail read.
        self._fd_buffered = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._fd_direct: int | None = None
        self.direct = False
        if direct:
            self._open_direct()
        if not self.direct:
            self._advise_random()
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="espn-posix-io")

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
                os.preadv(fd, [memoryview(probe)], 0)
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

    def _buffer(self, nbytes: int) -> mmap.mmap:
        """A page-aligned buffer of at least `nbytes`, private to the calling thread.

        Reusing it across calls is safe: the base copies what it gathers out of it before
        `read` returns, and another thread never sees it.
        """
        buf = getattr(self._local, "buf", None)
        if buf is not None and len(buf) >= nbytes:
            return buf
        buf = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
        if nbytes <= _REUSE_LIMIT:
            self._local.buf = buf
        return buf

    def _read_extent(self, view: memoryview, file_offset: int) -> None:
        """Fill `view` from `file_offset`; zero what lies past the end of the file."""
        want = len(view)
        got = 0
        while got < want:
            fd = self._fd_direct if self.direct and got % self.layout.block_size == 0 else self._fd_buffered
            assert fd is not None, "reader is closed"
            try:
                n = os.preadv(fd, [view[got:]], file_offset + got)
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                if exc.errno == errno.EINVAL and fd == self._fd_direct:
                    self._disable_direct(f"read: {exc.strerror}")
                    continue
                raise
            if n == 0:  # end of file: an unpadded file; the tail is not part of any record
                view[got:] = bytes(want - got)
                return
            got += n

    def _read_group(self, buf: mmap.mmap, plan: ExtentPlan, indices: range) -> None:
        whole = memoryview(buf)
        try:
            for i in indices:
                start = int(plan.buffer_offsets[i])
                self._read_extent(whole[start : start + int(plan.lengths[i])], int(plan.file_offsets[i]))
        finally:
            whole.release()

    def _fetch(self, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
        plan = plan_extents(offsets, lengths, self.layout.block_size, self.max_extent_bytes)
        buf = self._buffer(plan.nbytes)
        m = len(plan)
        workers = min(m, self.io_threads)
        if workers <= 1:
            self._read_group(buf, plan, range(m))
        else:
            # Interleaved groups, one task per worker: `workers` requests in flight with
            # a handful of futures instead of one per extent.
            futures = [self._pool.submit(self._read_group, buf, plan, range(w, m, workers)) for w in range(workers)]
            # Wait for all before raising: a straggler must not write into this thread's
            # buffer after the call has returned.
            wait(futures)
            for future in futures:
                future.result()  # re-raises an I/O error from a worker here
        array = np.frombuffer(buf, dtype=np.uint8, count=plan.nbytes)
        return array, plan.starts, plan.nbytes, m

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._pool.shutdown(wait=True)
        self._local = threading.local()  # drops the calling thread's buffer now
        for fd in (self._fd_direct, self._fd_buffered):
            if fd is not None:
                os.close(fd)
        self._fd_direct = None
