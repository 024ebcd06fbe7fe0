"""The default reader on a GPU machine: `kvikio.CuFile.pread` of every extent at once.

Written against kvikio 26.10 (`kvikio-cu12`; its Python sources and libkvikio headers were
read for what follows). Nothing here has been measured on a GPU yet: see docs/guides/gpus.md
(how to measure on one).

What kvikio does with a read, and what this reader configures at open
---------------------------------------------------------------------
`CuFile.pread(buf, size, file_offset, task_size)` on device memory takes one of two paths:

- `size < gds_threshold`: a *synchronous shortcut in the calling thread*: a POSIX `pread`
  into a pinned bounce buffer, a copy to the device and a stream synchronise, then a future
  that is already done. kvikio's default threshold is 16 KiB (the value 26.10 reports at
  start; its header comment says 1 MiB), so every 4 KiB record of a default index would be
  read one at a time, in the searcher's thread, and `submit` would not return before the
  last one had arrived.
- otherwise the read is split into `task_size` tasks on kvikio's thread pool (default: one
  thread); each task is a `cuFileRead` (GPUDirect Storage: the SSD DMAs into GPU memory)
  or, in kvikio's compatibility mode, a POSIX read into a per-thread bounce buffer copied
  to the device on that thread's own stream.

So the reader sets, at open (process-wide: kvikio has one set of defaults per process):
  nthreads=16 (`num_threads`): 16 extents really in flight together, where the default 1
      would serialise them;
  gds_threshold=4096: **a 4 KiB record (one block) is at the threshold, so it goes through
      the thread pool** (cuFile with GDS, kvikio's POSIX path in compatibility mode) and
      never through the synchronous shortcut; `submit` returns with all of it in flight;
  task_size=1 MiB (= the extent cap): one task per extent, no further split;
  bounce_buffer_size=1 MiB: the compatibility path takes a pinned buffer per read in
      flight, and one task fits in 1 MiB: 16 x 1 MiB pinned instead of 16 x 16 MiB;
  compat_mode=None leaves kvikio's choice (`KVIKIO_COMPAT_MODE`, else AUTO: cuFile where
      libcufile and the driver allow it).
An option given to the reader overrides the `KVIKIO_*` environment variable of the same
setting; `deploy/` sets the variables to these same defaults, so that kvikio starts out
configured as the reader will leave it. `engine` says which path the reads take:
"kvikio-gds" (cuFile) or "kvikio-compat" (kvikio's POSIX path), from
`kvikio.defaults.is_compat_mode_preferred()`.

cuFile's batch API (`cuFileBatchIOSubmit`) is not used: kvikio 26.10 has it in C++
(`kvikio::BatchHandle`) but exposes no Python binding, and driving `cuda.bindings.cufile`
directly would mean a second cuFile handle and driver session next to kvikio's. With the
thread pool sized, every extent of a wave is queued by one Python loop over numpy arrays
and up to `nthreads` of them are in flight at once.

Buffers and synchronisation
---------------------------
Each wave reads into one buffer taken from a reader-owned pool (`DeviceBufferPool` on CUDA,
the page-aligned host `BufferPool` otherwise); no `torch.empty` per read. cuFile writes are
not ordered with any CUDA stream, which is why the buffers are the reader's own and never
come back from torch's caching allocator while a kernel may still read them.

There is exactly one wait per wave, in `Fetch.complete()`: the host waits for every
future of the wave (whichever thread calls it, the searcher's main thread or a re-rank
worker). It is needed because the parse kernels must not be queued before the DMA has
landed, and nothing on a stream can express that. There is no stream synchronise in the
reader: the parse (`gather_records`) is queued on the caller's current stream and copies
the records out into fresh tensors, and `Fetch.release()` records a CUDA event on that
stream with the buffer. The pool hands the buffer out again only once that event has
completed (a buffer whose event is still pending is skipped; only when the pool is at its
cap does it wait on the oldest event; a buffer dropped beyond the cap, or by `close`, is
freed only once its event has completed, so torch's allocator never hands memory to
another kernel while a parse still reads it). kvikio itself, in GDS mode, synchronises the CUDA
null stream once per `pread` call (`sync_default_stream=true`, not exposed to Python): it
waits for work on the legacy default stream, and is cheap when the caller's kernels run on
a non-blocking stream such as torch's side streams.

Failures and lifetimes (the ownership rule of `engines/base.py`): a wave claims its
buffer in the ledger until every future of the wave is done; a wave that fails part-way
through its submission, or is abandoned, waits for the futures it started before the
buffer goes back, and a buffer given back while a future still runs is quarantined.
kvikio's `IOFuture.get()` for a read split into several tasks raises at the first failed
task while the others may still be writing (libkvikio gathers them in order), so the
reader keeps every extent within one task (`max_extent_bytes` <= `task_size`): a future
that has raised is then a read that is over. `close` refuses new reads and waits for
every wave in flight before it closes the file.

End of file: kvikio raises at EOF ("POSIX error on pread: EOF") instead of returning a short
count, so the extent that reaches past the end of an unpadded file is clamped to the file
size before it is issued; the bytes after it belong to no record.

kvikio needs libcuda at read time (importing it does not), so it is an optional extra
(`pip install "espn[kvikio]"`), imported only when this reader is opened or probed.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np
import torch

from ..errors import BackendUnavailableError, IndexCorruptError, InvalidParameterError
from .buffers import BufferPool, DeviceBufferPool
from .engines.errors import StoreClosedError
from .engines.ownership import LEDGER
from .extents import DEFAULT_MAX_EXTENT_BYTES, ExtentPlan, plan_extents
from .format import StoreLayout
from .kvikio_config import (DEFAULT_BOUNCE_BUFFER_SIZE, DEFAULT_GDS_THRESHOLD, DEFAULT_NTHREADS, DEFAULT_TASK_SIZE,
                            KvikioConfig)
from .pending import Fetch
from .reader import Reader
from .records import Buffer

__all__ = [
    "KvikioReader",
    "KvikioConfig",
    "DeviceBufferPool",
    "INSTALL_COMMAND",
    "DEFAULT_NTHREADS",
    "DEFAULT_GDS_THRESHOLD",
    "DEFAULT_TASK_SIZE",
    "DEFAULT_BOUNCE_BUFFER_SIZE",
]

logger = logging.getLogger(__name__)

INSTALL_COMMAND = 'pip install "espn[kvikio]"'


def _import_kvikio() -> ModuleType:
    # An optional extra (pip install "espn[kvikio]"), needing libcuda: imported only when asked for.
    import kvikio
    import kvikio.defaults

    return kvikio


def _cuda_available() -> bool:
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=1)
def _unavailable_reason() -> str | None:
    """Probe once per process: importing kvikio loads libkvikio, which is not free."""
    try:
        _import_kvikio()
    except Exception as exc:  # ImportError, or OSError when a shared library is missing
        return f"the kvikio reader needs kvikio ({type(exc).__name__}: {exc}); install it with: {INSTALL_COMMAND}"
    if not _cuda_available():
        # kvikio imports without libcuda, but every read asks the driver what memory it got.
        return (
            "the kvikio reader needs a CUDA device and a CUDA build of torch, and torch sees none; "
            f"on a GPU machine install the extra with: {INSTALL_COMMAND}"
        )
    return None


_config_lock = threading.Lock()
#: What the open readers applied; one asking for other values while another is open is logged.
_applied: dict[str, Any] = {}
_open_readers = 0


def configure_kvikio(kvikio: ModuleType, config: KvikioConfig) -> dict[str, Any]:
    """Apply `config` to kvikio's process-wide defaults; returns what kvikio reports after.

    Only settings that differ are set: resizing the thread pool waits for running tasks and
    rebuilds the pool, which another open reader would feel.
    """
    global _open_readers
    wanted = config.settings(kvikio)
    with _config_lock:
        if _open_readers and any(_applied.get(k, v) != v for k, v in wanted.items()):
            logger.warning("kvikio settings are per process: a reader changes them from %s to %s; "
                           "the readers already open now read with the new ones", _applied, wanted)
        _open_readers += 1
        changed = {k: v for k, v in wanted.items() if kvikio.defaults.get(k) != v}
        if changed:
            # Called without `with`: the values stay set (the context manager only resets on exit).
            kvikio.defaults.set(changed)
        _applied.update(wanted)
        actual = {k: kvikio.defaults.get(k) for k in ("num_threads", "gds_threshold", "task_size",
                                                       "bounce_buffer_size", "compat_mode")}
    mode = actual["compat_mode"]
    actual["compat_mode"] = str(getattr(mode, "name", mode)).lower()
    return actual


def _reader_closed() -> None:
    global _open_readers
    with _config_lock:
        _open_readers = max(0, _open_readers - 1)
        if not _open_readers:
            _applied.clear()


# -- the reader ------------------------------------------------------------------------------


class _KvikioFetch(Fetch):
    """The futures of one wave; `complete()` may run on any thread, once or many times."""

    def __init__(self, plan: ExtentPlan, buffer: Any, array: Buffer, futures: list[Any], nbytes: int, claim: int,
                 wait_all: Callable[[list[Any]], BaseException | None],
                 give_back: Callable[[Any, bool], None]) -> None:
        self._wait_all = wait_all  # the reader's: waits for every future, translating its error
        self._give_back = give_back  # the reader's: the buffer back to its pool
        self._plan = plan
        self._buffer = buffer  # what goes back to the pool
        self._array = array  # the 1-D uint8 view the base parses
        self._futures = futures
        self._nbytes = nbytes
        self._claim: int | None = claim
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._released = False

    @property
    def drained(self) -> bool:
        """Every future of the wave is done: kvikio writes no more into the buffer."""
        if self._claim is not None and all(f.done() for f in self._futures):
            LEDGER.settle(self._claim)
            self._claim = None
        return self._claim is None

    def _wait(self) -> None:
        """Under the lock: wait for every future once, keeping the first error."""
        if not self._done:
            self._error = self._wait_all(self._futures)
            self._done = True
            self.drained  # noqa: B018 - settles the claim

    def complete(self) -> tuple[Buffer, np.ndarray, int, int]:
        with self._lock:
            self._wait()
            if self._error is not None:
                raise self._error
        return self._array, self._plan.starts, self._nbytes, len(self._plan)

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` s for every future to be done, without taking their results
        (a reader closing under a wave in flight); True when drained."""
        deadline = time.monotonic() + timeout
        while not self.drained and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.drained

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            try:
                self._wait()  # never hand back a buffer kvikio may still write into
            finally:
                self._give_back(self._buffer, not self.drained)


class KvikioReader(Reader):
    """`kvikio.CuFile.pread` of coalesced extents, all in flight, into a pooled buffer.

    With a CUDA `device` the buffer is a CUDA tensor from the reader's `DeviceBufferPool`
    and the records are parsed on the GPU; with a CPU device kvikio reads into a pooled
    page-aligned host buffer. Options (all but `max_extent_bytes` are kvikio's
    process-wide settings, applied at open and reported by `describe()`):
      nthreads:           kvikio thread-pool size (default 16)
      gds_threshold:      smallest read that goes to the pool / cuFile (default 4096)
      task_size:          kvikio's split of one read into tasks (default 1 MiB)
      bounce_buffer_size: pinned bounce buffer per thread, compatibility mode (default 1 MiB;
                          None leaves kvikio's)
      compat_mode:        "on" (POSIX), "off" (cuFile), "auto", or None (kvikio's setting)
      max_extent_bytes:   cap on one coalesced request (default 1 MiB, rounded to blocks)
    bytes_read = sum of the extent sizes issued, ios = extents.
    """

    name = "kvikio"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return _unavailable_reason()

    def __init__(
        self,
        path: Path,
        records: np.ndarray,
        layout: StoreLayout,
        device: str | torch.device = "cpu",
        *,
        nthreads: int = DEFAULT_NTHREADS,
        gds_threshold: int = DEFAULT_GDS_THRESHOLD,
        task_size: int = DEFAULT_TASK_SIZE,
        bounce_buffer_size: int | None = DEFAULT_BOUNCE_BUFFER_SIZE,
        compat_mode: str | None = None,
        max_extent_bytes: int = DEFAULT_MAX_EXTENT_BYTES,
        **options: Any,
    ) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(reason)
        super().__init__(path, records, layout, device, **options)
        if isinstance(max_extent_bytes, bool) or not isinstance(max_extent_bytes, int) or max_extent_bytes < 1:
            raise InvalidParameterError(f"max_extent_bytes must be a positive integer, got {max_extent_bytes!r}")
        self.config = KvikioConfig(nthreads=nthreads, gds_threshold=gds_threshold, task_size=task_size,
                                   bounce_buffer_size=bounce_buffer_size, compat_mode=compat_mode)
        # One kvikio task per extent (see the module doc: a multi-task future raises before
        # its other tasks are done).
        cap = min(max_extent_bytes, self.config.task_size)
        self.max_extent_bytes = max(layout.block_size, cap - cap % layout.block_size)
        if self.config.gds_threshold > layout.block_size:
            logger.warning(
                "gds_threshold=%d is above the block size %d: one-block reads take kvikio's "
                "synchronous POSIX shortcut in the submitting thread", self.config.gds_threshold, layout.block_size)
        self._kvikio = _import_kvikio()
        # Before the CuFile: the compatibility mode of a file handle is fixed when it opens.
        self.settings = configure_kvikio(self._kvikio, self.config)
        self.compat = bool(self._kvikio.defaults.is_compat_mode_preferred())
        self.kvikio_version = str(getattr(self._kvikio, "__version__", "?"))
        self.device_buffers = self._is_cuda_device()
        self._device_pool = DeviceBufferPool(self.device) if self.device_buffers else None
        self._host_pool = BufferPool()
        self._waves: weakref.WeakSet[_KvikioFetch] = weakref.WeakSet()  # in flight, for close
        self._starting = 0  # submissions between the closed check and their fetch
        self._waves_cond = threading.Condition()
        try:
            self._file = self._kvikio.CuFile(self.path, "r")
        except BaseException:
            _reader_closed()
            raise

    def _is_cuda_device(self) -> bool:
        """Read into device memory? (Tests stand in for a GPU by patching this.)"""
        return self.device.type == "cuda"

    @property
    def engine(self) -> str:
        """"kvikio-gds" when reads go through cuFile, "kvikio-compat" for kvikio's POSIX path."""
        return "kvikio-compat" if self.compat else "kvikio-gds"

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "kvikio_version": self.kvikio_version,
            "nthreads": self.settings["num_threads"],
            "gds_threshold": self.settings["gds_threshold"],
            "task_size": self.settings["task_size"],
            "bounce_buffer_size": self.settings["bounce_buffer_size"],
            "compat_mode": self.settings["compat_mode"],
            "max_extent_bytes": self.max_extent_bytes,
            "device_buffers": self.device_buffers,
        }

    # -- reading --------------------------------------------------------------------------

    def _submit(self, offsets: np.ndarray, lengths: np.ndarray) -> Fetch:
        with self._waves_cond:
            if self.closed:
                raise StoreClosedError(f"the kvikio reader of {self.path} is closed")
            self._starting += 1
        try:
            fetch = self._start_wave(offsets, lengths)
            with self._waves_cond:
                self._waves.add(fetch)
            return fetch
        finally:
            with self._waves_cond:
                self._starting -= 1
                self._waves_cond.notify_all()

    def _start_wave(self, offsets: np.ndarray, lengths: np.ndarray) -> "_KvikioFetch":
        plan = plan_extents(offsets, lengths, self.layout.block_size, self.max_extent_bytes)
        # kvikio raises at EOF instead of returning a short count: clamp the last extent of
        # an unpadded file. Records end inside the file (checked at open), so no record
        # needs the bytes that are not read.
        sizes = np.minimum(plan.lengths, self.file_size - plan.file_offsets)
        buffer: Any
        array: Buffer
        if self._device_pool is not None:
            buffer = self._device_pool.acquire(plan.nbytes)
            array = buffer
        else:
            buffer = self._host_pool.acquire(plan.nbytes)
            array = np.frombuffer(buffer, dtype=np.uint8)
        futures: list[Any] = []
        claim = LEDGER.claim(*self._span(array), poll=lambda: all(f.done() for f in futures))
        pread, task_size = self._file.pread, self.config.task_size
        try:
            for file_offset, size, at in zip(plan.file_offsets.tolist(), sizes.tolist(),
                                             plan.buffer_offsets.tolist()):
                futures.append(pread(array[at : at + size], size, file_offset, task_size))
        except BaseException:
            try:
                self._wait_all(futures)  # none may write into the buffer once it is back in the pool
            finally:
                drained = all(f.done() for f in futures)
                if drained:
                    LEDGER.settle(claim)
                self._give_back(buffer, in_flight=not drained)
            raise
        return _KvikioFetch(plan, buffer, array, futures, int(sizes.sum()), claim, self._wait_all, self._give_back)

    @staticmethod
    def _span(array: Buffer) -> tuple[int, int]:
        if isinstance(array, torch.Tensor):
            return int(array.data_ptr()), int(array.numel() * array.element_size())
        return int(array.__array_interface__["data"][0]), int(array.nbytes)

    def _wait_all(self, futures: list[Any]) -> BaseException | None:
        """Wait for every future; the first error (as the reader raises it), or None."""
        error: BaseException | None = None
        for future in futures:
            try:
                future.get()
            except Exception as exc:  # kept; the others must finish before anyone raises
                error = error or self._translate(exc)
        return error

    def _translate(self, exc: Exception) -> BaseException:
        if "EOF" in str(exc):
            # Extents are clamped to the size seen at open: the file shrank since.
            err = IndexCorruptError(f"{self.path} ended before a record it should hold: {exc}")
            err.__cause__ = exc
            return err
        return exc

    def _give_back(self, buffer: Any, in_flight: bool = False) -> None:
        if isinstance(buffer, torch.Tensor):
            if self._device_pool is not None:
                self._device_pool.release(buffer, in_flight=in_flight)
        else:
            self._host_pool.release(buffer, in_flight=in_flight)

    @property
    def buffer_pool(self) -> "BufferPool | DeviceBufferPool":
        """The pool the waves read into (device buffers on CUDA, host ones otherwise)."""
        return self._device_pool if self._device_pool is not None else self._host_pool

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new reads, wait (up to `timeout` s) for every wave in flight, close the file.
        A wave still running after that keeps the file open and its buffer quarantined."""
        deadline = time.monotonic() + timeout
        with self._waves_cond:
            if self.closed:
                return
            super().close()
            self._waves_cond.wait_for(lambda: not self._starting, timeout)
            waves = list(self._waves)
        _reader_closed()
        stuck = [w for w in waves if not w.drain(max(0.0, deadline - time.monotonic()))]
        if stuck:
            logger.warning("kvikio reader of %s closed with %d wave(s) still reading after %g s: the file "
                           "stays open for them", self.path, len(stuck), timeout)
        else:
            self._file.close()
        if self._device_pool is not None:
            self._device_pool.clear()
        self._host_pool.clear()
