"""The reader contract: doc numbers -> CLS/BOW tensors, whatever the storage path.

The base class owns everything the backends share: validation of doc numbers, the
record lookup and its checks, and the read loop (`submit` -> `PendingRead`, parsed by
`espn.store.gather`). A backend implements one hook, `_fetch(offsets, lengths) -> (buffer,
starts)`, that brings the requested records into one byte buffer (numpy on the host, or a
torch tensor on the GPU for kvikio), or `_submit` for asynchronous reads.

The pieces around it live beside it: `records` (ReadBatch, RecordBatch), `pending` (reads
in flight), `buffers` (the host buffer pool), `extents` (block planning), `gather` (bytes
-> tensors).
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import IndexCorruptError, InvalidParameterError
from .engines.errors import StoreClosedError
from .format import RECORD_DTYPE, StoreLayout, record_nbytes
from .pending import DeferredFetch, Fetch, FetchPart, PendingRead
from .records import Buffer, ReadBatch

__all__ = ["Reader"]


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
    #: True where a read copies the records into a buffer of its own (what a search holds in
    #: RAM while its reads are in flight); False where it hands out views of memory it keeps.
    reads_into_buffers: ClassVar[bool] = True
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
        #: How the index's RAM was split for this reader (`espn.store.ram_plan.RamPlan.to_json`), if it was.
        self.ram_plan: dict[str, Any] | None = None
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
        """What `/readyz` and the stats report about this reader (and the RAM plan it was opened with)."""
        out: dict[str, Any] = {"reader": self.name, "engine": self.engine, "device": str(self.device)}
        if self.ram_plan is not None:
            out["ram"] = self.ram_plan
        return out

    def close(self) -> None:
        """Release files, threads and buffers; idempotent."""
        self.closed = True

    def ensure_open(self) -> None:
        """Raise StoreClosedError once `close` has begun (a search then retries on its successor).

        A backend whose `_fetch` hands out a buffer that `close` frees (memory, mmap) takes the
        buffer first and calls this after: a close that comes later cannot free what it took,
        and one that came earlier is refused here instead of scored from freed memory."""
        if self.closed:
            raise StoreClosedError(f"the {self.name} reader of {self.path} is closed")

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

    def start_fetches(self, doc_numbers: np.ndarray) -> list[FetchPart]:
        """Validate, look up the records and start fetching them: what `PendingRead.submit`
        calls (use `submit` or `read` instead). One part here; a reader whose documents come
        from several places (a record cache's hits and misses) returns one part for each."""
        return [FetchPart(*self.start_fetch(doc_numbers))]

    def forget(self, doc_numbers: np.ndarray) -> None:
        """The documents `doc_numbers` were deleted or replaced: nothing to do for a reader that
        keeps no record; a cache drops theirs."""

    def start_fetch(self, doc_numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray, Fetch | None]:
        """Validate, look up the records and start their fetch from storage: (docs, n_bow, fetch
        or None). The one part of `start_fetches`."""
        self.ensure_open()
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
        return DeferredFetch(self._fetch, offsets, lengths)

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
