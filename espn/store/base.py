"""The reader contract: doc numbers -> padded CLS/BOW tensors, whatever the storage path.

The base class owns everything the backends share: validation of doc numbers, the
padded shapes, and a vectorised parse of the fetched bytes into tensors. A backend
implements one hook, `_fetch(offsets, lengths) -> (buffer, starts)`, that brings the
requested records into one byte buffer (numpy on the host, or a torch tensor on the
GPU for kvikio); the base then views that buffer as fp16 and gathers CLS and BOW with
index arrays, on the buffer's device. `plan_extents` is the block planning that the
direct-I/O backends (posix, kvikio) share.
"""

from __future__ import annotations

import abc
import dataclasses
import errno
import functools
import logging
import mmap
import threading
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any, ClassVar, Union

import numpy as np
import torch

from ..errors import IndexCorruptError, InvalidParameterError
from .engines import base as _engines
from .engines.base import CANARY, ReturnGuard, StoreClosedError
from .format import RECORD_DTYPE, StoreLayout, dequantize_int8, record_nbytes

__all__ = [
    "ReadBatch",
    "RecordBatch",
    "PendingRead",
    "Fetch",
    "BufferPool",
    "Reader",
    "ExtentPlan",
    "plan_extents",
    "DEFAULT_MAX_EXTENT_BYTES",
]

logger = logging.getLogger(__name__)

#: Largest single read request the planners issue; adjacent blocks beyond it are split
#: into several requests so that many of them can be in flight at once.
DEFAULT_MAX_EXTENT_BYTES = 1 << 20

#: What `_fetch` may return as its buffer: 1-D uint8, host numpy or a torch tensor.
Buffer = Union[np.ndarray, torch.Tensor]


@dataclasses.dataclass
class ReadBatch:
    """The embeddings of `n` documents: CLS rows, and every BOW vector concatenated.

    cls:        [n, d_cls] float16 on the reader's device
    vectors:    [T, d_bow] float16, the BOW vectors of document 0, then 1, ... (no padding)
    offsets:    [n + 1] int64 (numpy): document i owns vectors[offsets[i]:offsets[i + 1]]
    bytes_read: bytes actually requested from storage (0 for memory; an estimate for mmap)
    ios:        read requests issued (after coalescing)
    docs:       [n] int64 the document number of each row (rows follow the request order of
                `read`; `PendingRead.result(select=...)` rows follow the order reads completed)

    `bow` and `mask` give the padded view ([n, L, d_bow] with zeros past each document's
    vectors, [n, L] bool, L = max(1, longest)) for callers that want one; the search path
    scores the flat form and never pads.
    """

    cls: torch.Tensor
    vectors: torch.Tensor
    offsets: np.ndarray
    bytes_read: int
    ios: int
    docs: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.cls.shape[0])

    def rows_of(self, doc_numbers: np.ndarray) -> np.ndarray:
        """[m] int64 the row holding each of `doc_numbers` (each must be in the batch)."""
        docs = self.docs if self.docs is not None else np.arange(len(self))
        order = np.argsort(docs, kind="stable")
        return order[np.searchsorted(docs[order], doc_numbers)]

    @property
    def n_bow(self) -> np.ndarray:
        """[n] int64 BOW vectors per document."""
        return np.diff(self.offsets)

    @functools.cached_property
    def _padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        n_bow = self.n_bow
        n, length = len(n_bow), max(1, int(n_bow.max()) if len(n_bow) else 0)
        device = self.vectors.device
        mask = torch.arange(length, device=device)[None, :] < torch.from_numpy(n_bow).to(device)[:, None]
        bow = torch.zeros((n, length, self.vectors.shape[1]), dtype=self.vectors.dtype, device=device)
        bow[mask] = self.vectors
        return bow, mask

    @property
    def bow(self) -> torch.Tensor:
        return self._padded[0]

    @property
    def mask(self) -> torch.Tensor:
        return self._padded[1]


@dataclasses.dataclass
class RecordBatch:
    """Documents' records where the reads left them, not parsed: what `espn.maxsim.score_records`
    scores without gathering or decoding them first (`PendingRead.records`).

    docs:      [n] int64 document number of each row (rows in the order the reads completed)
    n_bow:     [n] int64 its BOW vectors
    buffers:   the buffers holding the records (1-D uint8: numpy on the host, or a torch tensor
               on the reader's device), one per read
    buffer_of: [n] int64 which buffer holds each row's record
    starts:    [n] int64 byte position of each row's record in its buffer
    bytes_read, ios: what the reads cost

    The buffers belong to the reader's pool: call `release()` (or use it as a context
    manager) once scored, and never use the batch after that.
    """

    docs: np.ndarray
    n_bow: np.ndarray
    buffers: list[Buffer]
    buffer_of: np.ndarray
    starts: np.ndarray
    bytes_read: int
    ios: int
    _parts: list["_Part"] = dataclasses.field(default_factory=list, repr=False)

    def __len__(self) -> int:
        return len(self.docs)

    def rows_of(self, doc_numbers: np.ndarray) -> np.ndarray:
        """[m] int64 the row holding each of `doc_numbers` (each must be in the batch)."""
        order = np.argsort(self.docs, kind="stable")
        return order[np.searchsorted(self.docs[order], doc_numbers)]

    def addresses(self) -> np.ndarray:
        """[n] int64 host address of each row's record (host buffers only: the native scorer's input)."""
        bases = np.array([_host_address(buffer) for buffer in self.buffers], dtype=np.int64)
        return bases[self.buffer_of] + self.starts if len(self.buffers) else np.zeros(0, np.int64)

    def release(self) -> None:
        """Give the buffers back to the reader (idempotent)."""
        parts, self._parts = self._parts, []
        self.buffers = []
        for part in parts:
            part.release()

    def __enter__(self) -> "RecordBatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _host_address(buffer: Buffer) -> int:
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise ValueError("records on a GPU have no host address; score them with torch")
        return int(buffer.data_ptr())
    return int(buffer.__array_interface__["data"][0])


class Fetch(abc.ABC):
    """One backend read in flight (what `Reader._submit` returns)."""

    @abc.abstractmethod
    def complete(self) -> tuple[Buffer, np.ndarray, int, int]:
        """Wait for the read; (buffer, starts, bytes_read, ios) as `Reader._fetch` returns them."""

    def release(self) -> None:
        """The buffer has been parsed, or is abandoned: give it back (pooled backends) once no
        read targets it any more (drain it first, or quarantine it). Idempotent."""

    def cancel(self) -> None:
        """Withdraw what has not been handed to the storage yet (a search being abandoned);
        `complete` or `release` still reaps the rest."""


class _DeferredFetch(Fetch):
    """The default for backends without asynchronous reads: `_fetch` runs at `complete`."""

    def __init__(self, reader: "Reader", offsets: np.ndarray, lengths: np.ndarray) -> None:
        self._call = (reader, offsets, lengths)

    def complete(self) -> tuple[Buffer, np.ndarray, int, int]:
        reader, offsets, lengths = self._call
        return reader._fetch(offsets, lengths)


class PendingRead:
    """Reads in flight, parsed together: `submit` adds documents (their reads start at once),
    `result()` waits for every one and parses them into one ReadBatch.

    A search submits each prefetch wave and then its misses into one group and scores the
    result in one call: one gather into preallocated tensors, however many waves there were,
    and (with `select`) only of the documents that are finally scored. Call `result()` or
    `discard()` on the thread that submitted: ring-based engines keep a ring per thread.
    """

    def __init__(self, reader: "Reader") -> None:
        self._reader = reader
        self._parts: list[_Part] = []
        self._result: ReadBatch | None = None

    def submit(self, doc_numbers: np.ndarray, executor: Executor | None = None) -> "PendingRead":
        """Start reading more documents; returns self.

        With an executor, the planning, the submission and the wait for completion run on one
        of its threads (which owns its I/O ring): the caller pays one future per call, so a
        search thread scanning clusters is not slowed by reads it starts.
        """
        if self._result is not None:
            raise ValueError("this read has already been parsed; submit into a new one")
        if executor is None:
            self._parts.append(_Part(*self._reader._start(doc_numbers)))
        else:
            reader = self._reader

            def start_and_wait() -> _Part:
                part = _Part(*reader._start(doc_numbers))
                try:
                    part.wait()
                except BaseException:
                    part.release()
                    raise
                return part

            try:
                future = executor.submit(start_and_wait)
            except RuntimeError:  # the executor is shut down (its owner is closing): read here instead
                self._parts.append(_Part(*self._reader._start(doc_numbers)))
                return self
            self._parts.append(_Part(np.zeros(0, np.int64), np.zeros(0, np.int64), None, future=future))
        return self

    def wait(self) -> None:
        """Wait for the I/O of everything submitted so far, without parsing it."""
        for part in self._parts:
            part.wait()

    def result(self, select: np.ndarray | None = None) -> ReadBatch:
        """Wait for every read and parse it, once.

        select: sorted unique doc numbers to parse (each must have been submitted), one row each,
        in no particular order (`ReadBatch.docs` and `rows_of` say which row holds which).
        None: every submitted document, in submission order (duplicates keep their rows).
        """
        if self._result is None:
            parts, self._parts = self._parts, []
            self._result = self._reader._complete(parts, select)
        return self._result

    def records(self, select: np.ndarray | None = None) -> RecordBatch:
        """Wait for every read and hand over the records where they lie, unparsed, once.

        select: as for `result`. The caller owns the buffers until `RecordBatch.release()`.
        """
        if self._result is not None:
            raise ValueError("this read has already been parsed")
        parts, self._parts = self._parts, []
        return self._reader._records(parts, select)

    def discard(self) -> None:
        """Cancel what has not gone to the storage yet and wait for the rest without parsing
        it (a search that failed part-way, or was abandoned). Cancellations are not errors."""
        parts, self._parts = self._parts, []
        try:
            for part in parts:
                part.cancel()
            error = _wait_all(parts)  # every read must finish before the buffers go back
        finally:
            for part in parts:
                part.release()
        if error is not None and getattr(error, "errno", None) != errno.ECANCELED:
            raise error


@dataclasses.dataclass
class _Part:
    """One `submit` of a PendingRead: its documents, their BOW counts, the fetch in flight and,
    once waited for, what the fetch brought."""

    docs: np.ndarray
    n_bow: np.ndarray
    fetch: Fetch | None
    done: tuple[Buffer, np.ndarray, int, int] | None = None
    future: Future | None = None  # started and waited for on an executor thread

    def wait(self) -> tuple[Buffer, np.ndarray, int, int] | None:
        if self.future is not None:
            future, self.future = self.future, None
            if future.cancelled():  # cancelled before it started: nothing was read
                return None
            ran: _Part = future.result()  # re-raises the worker's error
            self.docs, self.n_bow, self.fetch, self.done = ran.docs, ran.n_bow, ran.fetch, ran.done
        if self.done is None and self.fetch is not None:
            self.done = self.fetch.complete()
        return self.done

    def cancel(self) -> None:
        if self.future is not None:
            self.future.cancel()  # not started yet: it never will be
        elif self.fetch is not None and self.done is None:
            self.fetch.cancel()

    def release(self) -> None:
        if self.future is not None:  # abandoned: the worker's read must end before its buffer goes back
            future, self.future = self.future, None
            if not future.cancel() and future.exception() is None:
                future.result().release()
        if self.fetch is not None:
            self.fetch.release()
            self.fetch = None


def _fault_point(name: str) -> None:
    """Where a test's fault injector may interrupt the read path between syscalls."""
    faults = _engines._faults
    if faults is not None:
        faults.point(name)


def _wait_all(parts: list[_Part]) -> BaseException | None:
    """Wait for every part, even after one fails; the first error, or None."""
    error: BaseException | None = None
    for part in parts:
        try:
            part.wait()
        except BaseException as exc:
            error = error or exc
    return error


def _pick(parts: list[_Part], select: np.ndarray) -> list[np.ndarray]:
    """Per part, which of its documents become rows: each of the sorted `select` once."""
    select = np.asarray(select, dtype=np.int64)
    taken = np.zeros(len(select), dtype=bool)
    picks = []
    for docs in (p.docs for p in parts):
        if len(select) == 0 or len(docs) == 0:
            picks.append(np.zeros(0, dtype=np.int64))
            continue
        at = np.minimum(np.searchsorted(select, docs), len(select) - 1)
        idx = np.flatnonzero((select[at] == docs) & ~taken[at])
        idx = idx[np.unique(at[idx], return_index=True)[1]]  # one row per document
        taken[at[idx]] = True
        picks.append(idx)
    if not taken.all():
        raise ValueError("select names documents that were never submitted")
    return picks


def _mmap_span(buf: mmap.mmap) -> tuple[int, int]:
    return int(np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]), len(buf)


def _mmap_fill(buf: mmap.mmap) -> None:
    np.frombuffer(buf, dtype=np.uint8).fill(CANARY)


def _mmap_intact(buf: mmap.mmap) -> bool:
    return bool((np.frombuffer(buf, dtype=np.uint8) == CANARY).all())


class BufferPool:
    """Page-aligned anonymous buffers, reused across reads.

    A fresh mapping costs a page fault per 4 KiB on first touch; reusing buffers keeps that
    off the read path. Buffers are kept in power-of-two size classes up to `retain_bytes`
    in total; beyond that a released buffer is dropped.

    Every buffer that comes back passes the ownership check (`engines.base.ReturnGuard`):
    one that a read in flight still targets is quarantined, never reused, until the read
    drains (an OwnershipError under the strict policy, unless the caller said so).
    """

    MIN_BYTES = 1 << 16

    def __init__(self, retain_bytes: int = 64 << 20) -> None:
        self.retain_bytes = retain_bytes
        self._free: dict[int, list[mmap.mmap]] = {}
        self._retained = 0
        self._in_use = 0
        self._lock = threading.Lock()
        self._guard = ReturnGuard("host read buffer", _mmap_span, _mmap_fill, _mmap_intact)

    @staticmethod
    def _size_class(nbytes: int) -> int:
        return max(BufferPool.MIN_BYTES, 1 << (max(1, nbytes) - 1).bit_length())

    def acquire(self, nbytes: int) -> mmap.mmap:
        if self._guard.quarantined:
            for buf in self._guard.reclaim():
                self._keep(buf)
        size = self._size_class(nbytes)
        with self._lock:
            self._in_use += 1
            free = self._free.get(size)
            if free:
                self._retained -= size
                buf = free.pop()
            else:
                buf = None
        if buf is None:
            return mmap.mmap(-1, size)
        try:
            self._guard.handing_out(buf)
        except BaseException:
            with self._lock:
                self._in_use -= 1
            raise
        return buf

    def release(self, buf: mmap.mmap, in_flight: bool = False) -> None:
        """Give `buf` back. in_flight: the caller knows reads may still target it (a failure
        it could not drain): it is quarantined until they have drained, without an error."""
        with self._lock:
            self._in_use -= 1
        if self._guard.give_back(buf, known_in_flight=in_flight):
            self._keep(buf)

    def _keep(self, buf: mmap.mmap) -> None:
        size = len(buf)
        with self._lock:
            if size == self._size_class(size) and self._retained + size <= self.retain_bytes:
                self._free.setdefault(size, []).append(buf)
                self._retained += size
                return
        self._guard.forget(buf)

    def check(self) -> None:
        """Check that no free buffer changed since it came back (canary policy; tests)."""
        with self._lock:
            free = [b for bufs in self._free.values() for b in bufs]
        self._guard.check(free)

    def stats(self) -> dict[str, int]:
        """free buffers, bytes they hold, buffers handed out and not back, quarantined ones."""
        with self._lock:
            free = sum(len(b) for b in self._free.values())
            retained, in_use = self._retained, self._in_use
        return {"free": free, "retained_bytes": retained, "in_use": in_use, "quarantined": self._guard.quarantined}

    def clear(self) -> None:
        with self._lock:
            for bufs in self._free.values():
                for buf in bufs:
                    self._guard.forget(buf)
            self._free.clear()
            self._retained = 0


@dataclasses.dataclass(frozen=True)
class ExtentPlan:
    """Which aligned byte ranges to read, and where each record lands in the buffer.

    The extents are laid end to end in one buffer of `nbytes` bytes in the order given,
    so a record that spans two extents (a coalesced run split at the size cap) is still
    contiguous in the buffer.

    file_offsets:   [m] int64, byte offset of each extent in the file (block-aligned)
    lengths:        [m] int64, byte length of each extent (whole blocks, <= the cap)
    buffer_offsets: [m] int64, where each extent goes in the buffer (exclusive cumsum)
    starts:         [n] int64, byte position of each requested record in the buffer
    nbytes:         total buffer size, sum(lengths)
    """

    file_offsets: np.ndarray
    lengths: np.ndarray
    buffer_offsets: np.ndarray
    starts: np.ndarray
    nbytes: int

    def __len__(self) -> int:
        return len(self.file_offsets)


def plan_extents(
    offsets: np.ndarray,
    lengths: np.ndarray,
    block_size: int,
    max_extent_bytes: int = DEFAULT_MAX_EXTENT_BYTES,
) -> ExtentPlan:
    """Coalesce the block ranges of the requested records into few aligned reads.

    offsets, lengths: [n] int64 byte offset and length of each record (any order,
    duplicates allowed). Each record needs blocks [offset // B, ceil((offset + length) / B));
    the ranges are sorted, and overlapping or adjacent ones merged into runs (so two
    records in one block, or consecutive documents, cost one request). Runs longer than
    `max_extent_bytes` (rounded down to whole blocks, at least one block) are split, so
    that a large request does not serialise behind one request. Vectorised: no Python
    loop over records.

    >>> p = plan_extents(np.array([0, 100, 4096, 12288]), np.array([100, 50, 10, 10]), 4096)
    >>> p.file_offsets.tolist(), p.lengths.tolist(), p.starts.tolist()
    ([0, 12288], [8192, 4096], [0, 100, 4096, 8192])
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if offsets.shape != lengths.shape:
        raise ValueError(f"offsets and lengths differ in shape: {offsets.shape} vs {lengths.shape}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    empty = np.zeros(0, dtype=np.int64)
    n = len(offsets)
    if n == 0:
        return ExtentPlan(empty, empty, empty, empty, 0)

    bsz = int(block_size)
    first = offsets // bsz
    # ceil division; a zero-length record still gets its block so that `starts` is valid.
    end = np.maximum(-(-(offsets + lengths) // bsz), first + 1)

    order = np.argsort(first, kind="stable")
    f_sorted, e_sorted = first[order], end[order]
    reach = np.maximum.accumulate(e_sorted)  # furthest block covered so far
    new_run = np.ones(n, dtype=bool)
    new_run[1:] = f_sorted[1:] > reach[:-1]  # equal means adjacent: merge
    run_starts_idx = np.flatnonzero(new_run)
    run_first = f_sorted[run_starts_idx]
    run_end = reach[np.append(run_starts_idx[1:] - 1, n - 1)]
    run_blocks = run_end - run_first
    run_buf = np.zeros(len(run_first), dtype=np.int64)
    np.cumsum(run_blocks[:-1] * bsz, out=run_buf[1:])

    run_of_doc = np.empty(n, dtype=np.int64)
    run_of_doc[order] = np.cumsum(new_run) - 1
    starts = run_buf[run_of_doc] + offsets - run_first[run_of_doc] * bsz

    # Split runs into extents of at most `cap` blocks; they stay contiguous in the buffer.
    cap = max(1, int(max_extent_bytes) // bsz)
    n_chunks = -(-run_blocks // cap)
    ext_run = np.repeat(np.arange(len(run_first)), n_chunks)
    chunk = np.arange(int(n_chunks.sum())) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
    ext_first = run_first[ext_run] + chunk * cap
    ext_blocks = np.minimum(cap, run_end[ext_run] - ext_first)
    ext_lengths = ext_blocks * bsz
    ext_buf = run_buf[ext_run] + chunk * cap * bsz
    return ExtentPlan(
        file_offsets=ext_first * bsz,
        lengths=ext_lengths,
        buffer_offsets=ext_buf,
        starts=starts,
        nbytes=int(run_blocks.sum()) * bsz,
    )


class Reader(abc.ABC):
    """Reads the records of given doc numbers from embeddings.bin into padded tensors.

    path:    embeddings.bin
    records: RECORD_DTYPE [N] (offset, length, n_bow); may be an `np.load(mmap_mode='r')`
             memmap: only the requested rows are touched per read
    layout:  d_cls, d_bow, block_size
    device:  where the returned tensors live

    `read` is thread-safe in every backend: the server's prefetch thread and request
    threads share one reader. Use as a context manager or call `close()`.
    """

    name: ClassVar[str]
    #: True where a read waits on storage, so a prefetch wave has latency to hide behind the
    #: ANN scan; False where reading is CPU work (the memory reader): a wave would only add it.
    io_bound: ClassVar[bool] = True
    #: True where reads go to the file itself, so bytes appended after open are readable
    #: (`extend_records`); False for readers that hold a copy or a map of it (memory, mmap).
    follows_appends: ClassVar[bool] = True

    def __init__(
        self,
        path: Path,
        records: np.ndarray,
        layout: StoreLayout,
        device: str | torch.device = "cpu",
        **options: Any,
    ) -> None:
        if options:
            raise InvalidParameterError(
                f"unknown option(s) for the {self.name!r} reader: {', '.join(sorted(options))}"
            )
        if records.dtype.names is None or not {"offset", "length", "n_bow"} <= set(records.dtype.names):
            raise ValueError(f"records must have the fields of RECORD_DTYPE {RECORD_DTYPE}, got {records.dtype}")
        if records.ndim != 1:
            raise ValueError(f"records must be 1-D, got shape {records.shape}")
        self.path = Path(path)
        self.records = records
        self.layout = layout
        self.device = torch.device(device)
        self.closed = False
        if not self.path.is_file():
            raise IndexCorruptError(f"embedding file {self.path} does not exist")
        self.file_size = self.path.stat().st_size
        if len(records):
            # The record that ends furthest: any of a table (laid out in IVF-list order, say),
            # the last of a live index's rows (deltas are appended past the base's records).
            rows = records if isinstance(records, np.ndarray) else records[np.array([len(records) - 1])]
            end = int(np.max(np.asarray(rows["offset"], dtype=np.int64) + np.asarray(rows["length"], dtype=np.int64)))
            if end > self.file_size:
                raise IndexCorruptError(
                    f"{self.path} has {self.file_size} bytes but records.npy says a record "
                    f"ends at byte {end}"
                )

    # -- what a backend provides ---------------------------------------------------------

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot be used here (with the install command), or None."""
        return None

    @classmethod
    def is_available(cls) -> bool:
        """True when this backend's dependencies (and hardware) are present."""
        return cls.unavailable_reason() is None

    def _fetch(self, offsets: np.ndarray, lengths: np.ndarray) -> tuple[Buffer, np.ndarray, int, int]:
        """Bring the records into memory (the hook of synchronous backends; async ones
        override `_submit` instead).

        offsets, lengths: [n] int64, n >= 1, in request order (duplicates possible).
        Returns (buffer, starts, bytes_read, ios): buffer is 1-D uint8 (numpy, or a torch
        tensor on any device) holding every record, starts [n] int64 the byte position of
        record i in it (even, like every offset and length, so the buffer can be viewed as
        fp16). The buffer must not be shared with a concurrent call.
        """
        raise NotImplementedError(f"{type(self).__name__} implements neither _fetch nor _submit")

    @property
    def engine(self) -> str:
        """What moves the bytes (the posix reader names its I/O engine; others their own name)."""
        return self.name

    def describe(self) -> dict[str, Any]:
        """What `/readyz` and the stats report about this reader."""
        return {"reader": self.name, "engine": self.engine, "device": str(self.device)}

    def close(self) -> None:
        """Release files, threads and buffers; idempotent."""
        self.closed = True

    def extend_records(self, records: np.ndarray) -> bool:
        """Serve a longer records table over the same file: a live index's newer generation,
        whose rows for the doc numbers already served are unchanged (so reads in flight, and
        searches of older generations, are unaffected). False when this reader cannot (it
        does not follow appends, or `records` is shorter): the caller opens another."""
        if records is self.records:  # the table it was opened with: nothing to extend (no second copy)
            return True
        if not self.follows_appends or len(records) < len(self.records):
            return False
        self.file_size = self.path.stat().st_size
        self.records = records
        return True

    # -- the shared loop ------------------------------------------------------------------

    @property
    def num_documents(self) -> int:
        return len(self.records)

    def read(self, doc_numbers: np.ndarray) -> ReadBatch:
        """Embeddings of `doc_numbers` ([n] integers in [0, N)), rows in the order given.

        Duplicates are allowed (each gets its row); an empty request gives n = 0.
        Raises InvalidParameterError (a ValueError) when a number is out of range.
        """
        return self.submit(doc_numbers).result()

    def submit(self, doc_numbers: np.ndarray) -> PendingRead:
        """Start reading `doc_numbers` and return at once; `result()` gives the ReadBatch.

        Backends with asynchronous I/O (posix) have every read in flight when this returns;
        the others (memory, mmap) do the work in `result()`. Submit more into the returned
        object to have them parsed together.
        """
        return PendingRead(self).submit(doc_numbers)

    def _start(self, doc_numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray, Fetch | None]:
        """Validate, look up the records and start their fetch: (docs, n_bow, fetch or None)."""
        if self.closed:
            raise StoreClosedError(f"the {self.name} reader of {self.path} is closed")
        docs = self._validate(doc_numbers)
        lay = self.layout
        if len(docs) == 0:
            return docs, np.zeros(0, dtype=np.int64), None
        rows = self.records[docs]
        offsets = np.asarray(rows["offset"], dtype=np.int64)
        lengths = np.asarray(rows["length"], dtype=np.int64)
        n_bow = np.asarray(rows["n_bow"], dtype=np.int64)
        expected = np.asarray(record_nbytes(n_bow, lay))
        if np.any(lengths != expected) or np.any(offsets % 2) or np.any(offsets < 0):
            bad = int(docs[np.flatnonzero((lengths != expected) | (offsets % 2 != 0) | (offsets < 0))[0]])
            raise IndexCorruptError(
                f"record of doc {bad} does not match the layout d_cls={lay.d_cls}, d_bow={lay.d_bow}, "
                f"dtype={lay.dtype}: "
                f"{self.records[bad]}"
            )
        return docs, n_bow, self._submit(offsets, lengths)

    def _submit(self, offsets: np.ndarray, lengths: np.ndarray) -> Fetch:
        """Start a fetch; the default defers `_fetch` to `complete()`. Async backends override it."""
        return _DeferredFetch(self, offsets, lengths)

    def _complete(self, parts: list["_Part"], select: np.ndarray | None) -> ReadBatch:
        """Wait for every part and gather the wanted rows into one preallocated batch."""
        lay = self.layout
        try:
            error = _wait_all(parts)  # every read finished (or failed) before any buffer is parsed
            if error is not None:
                raise error
            _fault_point("gather")
            picks = [np.arange(len(p.docs)) for p in parts] if select is None else _pick(parts, select)
            counts = [p.n_bow[pick] for p, pick in zip(parts, picks)]
            n = sum(len(c) for c in counts)
            total = int(sum(int(c.sum()) for c in counts))
            cls = torch.empty((n, lay.d_cls), dtype=torch.float16, device=self.device)
            vectors = torch.empty((total, lay.d_bow), dtype=torch.float16, device=self.device)
            row_docs = np.zeros(n, dtype=np.int64)
            offsets = np.zeros(n + 1, dtype=np.int64)
            bytes_read = ios = 0
            row = vec = 0
            for part, pick, count in zip(parts, picks, counts):
                if part.done is None:
                    continue
                buffer, starts, got_bytes, got_ios = part.done
                bytes_read, ios = bytes_read + int(got_bytes), ios + int(got_ios)
                if len(pick):
                    m, t = len(pick), int(count.sum())
                    gather_records(buffer, np.asarray(starts)[pick], count, lay,
                                   cls_out=cls[row: row + m], vectors_out=vectors[vec: vec + t])
                    row_docs[row: row + m] = part.docs[pick]
                    np.cumsum(count, out=offsets[row + 1: row + m + 1])
                    offsets[row + 1: row + m + 1] += vec
                    row, vec = row + m, vec + t
        finally:
            for part in parts:
                part.release()
        return ReadBatch(cls=cls, vectors=vectors, offsets=offsets, bytes_read=bytes_read, ios=ios, docs=row_docs)

    def _records(self, parts: list["_Part"], select: np.ndarray | None) -> RecordBatch:
        """Wait for every part; the wanted rows' records in place (the parts are released by the batch)."""
        try:
            error = _wait_all(parts)
            if error is not None:
                raise error
            _fault_point("gather")
            picks = [np.arange(len(p.docs)) for p in parts] if select is None else _pick(parts, select)
            used = [i for i, (part, pick) in enumerate(zip(parts, picks)) if part.done is not None and len(pick)]
            buffers = [parts[i].done[0] for i in used]  # type: ignore[index]
            docs = [parts[i].docs[picks[i]] for i in used]
            batch = RecordBatch(
                docs=np.concatenate(docs) if docs else np.zeros(0, np.int64),
                n_bow=np.concatenate([parts[i].n_bow[picks[i]] for i in used]) if used else np.zeros(0, np.int64),
                buffers=buffers,
                buffer_of=np.repeat(np.arange(len(used), dtype=np.int64), [len(d) for d in docs]),
                starts=np.concatenate([np.asarray(parts[i].done[1], dtype=np.int64)[picks[i]] for i in used])  # type: ignore[index]
                if used else np.zeros(0, np.int64),
                bytes_read=sum(int(p.done[2]) for p in parts if p.done is not None),
                ios=sum(int(p.done[3]) for p in parts if p.done is not None),
                _parts=parts)
        except BaseException:
            for part in parts:
                part.release()
            raise
        return batch

    def _validate(self, doc_numbers: Any) -> np.ndarray:
        docs = np.asarray(doc_numbers)
        if docs.ndim != 1:
            raise InvalidParameterError(f"doc_numbers must be 1-D, got shape {docs.shape}")
        if docs.size == 0:
            return np.zeros(0, dtype=np.int64)
        if docs.dtype == np.bool_ or not np.issubdtype(docs.dtype, np.integer):
            raise InvalidParameterError(f"doc_numbers must be integers, got dtype {docs.dtype}")
        n = len(self.records)
        low, high = int(docs.min()), int(docs.max())
        if low < 0 or high >= n:
            raise InvalidParameterError(
                f"doc_numbers must be in [0, {n}), got {low if low < 0 else high}"
            )
        return docs.astype(np.int64, copy=False)

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, n={len(self.records)}, device={str(self.device)!r})"


def gather_records(
    buffer: Buffer, starts: np.ndarray, n_bow: np.ndarray, layout: StoreLayout,
    cls_out: torch.Tensor | None = None, vectors_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Parse records out of one byte buffer with index arrays, on the buffer's device.

    buffer: 1-D uint8 (numpy or torch); starts [n] int64 even byte positions; n_bow [n].
    Returns cls [n, d_cls] fp16, vectors [sum n_bow, d_bow] fp16 (each document's BOW
    vectors in turn) and offsets [n + 1] int64 (numpy); written into `cls_out` and
    `vectors_out` when given (preallocated rows of a larger batch). int8 records are
    decoded here, on the buffer's device (the GPU for kvikio: the device that scores).

    The buffer is viewed as fp16 and then as overlapping windows of d_cls / d_bow elements
    (a strided view, no copy), so one index per vector, not per element, picks the rows.
    """
    d_cls, d_bow = layout.d_cls, layout.d_bow
    flat_u8 = torch.from_numpy(buffer) if isinstance(buffer, np.ndarray) else buffer
    flat = flat_u8[: flat_u8.numel() - flat_u8.numel() % 2].view(torch.float16)
    device = flat.device
    n_bow = np.asarray(n_bow, dtype=np.int64)
    first = np.asarray(starts, dtype=np.int64) // 2
    offsets = np.zeros(len(n_bow) + 1, dtype=np.int64)
    np.cumsum(n_bow, out=offsets[1:])
    total = int(offsets[-1])
    if layout.dtype == "int8":
        return _gather_int8(flat_u8, flat, first, n_bow, offsets, layout, cls_out, vectors_out)
    # Element position of every BOW vector: the record's first BOW element + t·d_bow.
    within = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1], n_bow)
    rows = np.repeat(first + d_cls, n_bow) + within * d_bow
    # index_select, not `view[index]`: on a strided view advanced indexing takes a per-element
    # path that is ~13x slower (4 ms against 0.3 ms for 25k vectors of 64 dims).
    cls = _select_rows(flat.unfold(0, d_cls, 1), torch.from_numpy(first).to(device), cls_out)
    if total:
        vectors = _select_rows(flat.unfold(0, d_bow, 1), torch.from_numpy(rows).to(device), vectors_out)
    else:
        vectors = torch.zeros((0, d_bow), dtype=torch.float16, device=device) if vectors_out is None else vectors_out
    return cls, vectors, offsets


def _select_rows(view: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """view[index] by index_select, written into `out` (on any device) when given."""
    if out is None:
        return view.index_select(0, index)
    if out.device == view.device:
        return torch.index_select(view, 0, index, out=out)
    return out.copy_(view.index_select(0, index))


def _gather_int8(
    flat_u8: torch.Tensor, flat16: torch.Tensor, first: np.ndarray, n_bow: np.ndarray, offsets: np.ndarray,
    layout: StoreLayout, cls_out: torch.Tensor | None, vectors_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """`gather_records` for int8 records `[scales (1 + n) fp16][CLS int8][BOW n x int8]`.

    first: [n] the fp16 element where each record starts (its CLS scale). One index_select
    each for the scales, the CLS codes and the BOW codes, then one multiply per tensor.
    """
    d_cls, d_bow = layout.d_cls, layout.d_bow
    device = flat_u8.device
    total = int(offsets[-1])
    codes = flat_u8.view(torch.int8)
    cls_byte = 2 * (first + 1 + n_bow)  # the CLS codes follow the record's 1 + n scales
    cls_codes = codes.unfold(0, d_cls, 1).index_select(0, torch.from_numpy(cls_byte).to(device))
    cls_scales = flat16.index_select(0, torch.from_numpy(first).to(device))
    cls = dequantize_int8(cls_codes, cls_scales, cls_out)
    if not total:
        empty = torch.zeros((0, d_bow), dtype=torch.float16, device=device)
        return cls, empty if vectors_out is None else vectors_out, offsets
    within = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1], n_bow)
    scale_at = np.repeat(first + 1, n_bow) + within
    code_at = np.repeat(cls_byte + d_cls, n_bow) + within * d_bow
    bow_codes = codes.unfold(0, d_bow, 1).index_select(0, torch.from_numpy(code_at).to(device))
    bow_scales = flat16.index_select(0, torch.from_numpy(scale_at).to(device))
    return cls, dequantize_int8(bow_codes, bow_scales, vectors_out), offsets
