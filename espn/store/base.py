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
import logging
from pathlib import Path
from typing import Any, ClassVar, Union

import numpy as np
import torch

from ..errors import IndexCorruptError, InvalidParameterError
from .format import RECORD_DTYPE, STORAGE_DTYPE, StoreLayout

__all__ = [
    "ReadBatch",
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
    """The embeddings of `n` documents, padded to the longest bag of BOW vectors.

    cls:        [n, d_cls] float16 on the reader's device
    bow:        [n, L, d_bow] float16, L = max n_bow among the docs (>= 1); zeros where
                mask is False, so padding contributes nothing even unmasked
    mask:       [n, L] bool, True for the first n_bow[i] positions of row i
    bytes_read: bytes actually requested from storage (0 for memory; an estimate for mmap)
    ios:        read requests issued (after coalescing)
    """

    cls: torch.Tensor
    bow: torch.Tensor
    mask: torch.Tensor
    bytes_read: int
    ios: int

    def __len__(self) -> int:
        return int(self.cls.shape[0])


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
            # Records are appended in order, so the last one ends furthest.
            last = records[-1]
            if int(last["offset"]) + int(last["length"]) > self.file_size:
                raise IndexCorruptError(
                    f"{self.path} has {self.file_size} bytes but records.npy says the last "
                    f"record ends at byte {int(last['offset']) + int(last['length'])}"
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

    @abc.abstractmethod
    def _fetch(self, offsets: np.ndarray, lengths: np.ndarray) -> tuple[Buffer, np.ndarray, int, int]:
        """Bring the records into memory.

        offsets, lengths: [n] int64, n >= 1, in request order (duplicates possible).
        Returns (buffer, starts, bytes_read, ios): buffer is 1-D uint8 (numpy, or a torch
        tensor on any device) holding every record, starts [n] int64 the byte position of
        record i in it (even, like every offset and length, so the buffer can be viewed as
        fp16). The buffer must not be shared with a concurrent call.
        """

    def close(self) -> None:
        """Release files, threads and buffers; idempotent."""
        self.closed = True

    # -- the shared loop ------------------------------------------------------------------

    @property
    def num_documents(self) -> int:
        return len(self.records)

    def read(self, doc_numbers: np.ndarray) -> ReadBatch:
        """Embeddings of `doc_numbers` ([n] integers in [0, N)), rows in the order given.

        Duplicates are allowed (each gets its row); an empty request gives n = 0, L = 1.
        Raises InvalidParameterError (a ValueError) when a number is out of range.
        """
        if self.closed:
            raise ValueError(f"the {self.name} reader of {self.path} is closed")
        docs = self._validate(doc_numbers)
        lay = self.layout
        if len(docs) == 0:
            return ReadBatch(
                cls=torch.zeros((0, lay.d_cls), dtype=torch.float16, device=self.device),
                bow=torch.zeros((0, 1, lay.d_bow), dtype=torch.float16, device=self.device),
                mask=torch.zeros((0, 1), dtype=torch.bool, device=self.device),
                bytes_read=0,
                ios=0,
            )
        rows = self.records[docs]
        offsets = np.asarray(rows["offset"], dtype=np.int64)
        lengths = np.asarray(rows["length"], dtype=np.int64)
        n_bow = np.asarray(rows["n_bow"], dtype=np.int64)
        expected = (lay.d_cls + n_bow * lay.d_bow) * STORAGE_DTYPE.itemsize
        if np.any(lengths != expected) or np.any(offsets % 2) or np.any(offsets < 0):
            bad = int(docs[np.flatnonzero((lengths != expected) | (offsets % 2 != 0) | (offsets < 0))[0]])
            raise IndexCorruptError(
                f"record of doc {bad} does not match the layout d_cls={lay.d_cls}, d_bow={lay.d_bow}: "
                f"{self.records[bad]}"
            )
        buffer, starts, bytes_read, ios = self._fetch(offsets, lengths)
        cls, bow, mask = gather_records(buffer, starts, n_bow, lay)
        if cls.device != self.device:
            cls, bow, mask = (t.to(self.device) for t in (cls, bow, mask))
        return ReadBatch(cls=cls, bow=bow, mask=mask, bytes_read=int(bytes_read), ios=int(ios))

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
    buffer: Buffer, starts: np.ndarray, n_bow: np.ndarray, layout: StoreLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Parse records out of one byte buffer with index arrays, on the buffer's device.

    buffer: 1-D uint8 (numpy or torch), even length where records are; starts [n] int64
    even byte positions; n_bow [n]. Returns cls [n, d_cls] fp16, bow [n, L, d_bow] fp16
    (zeros past n_bow), mask [n, L] bool with L = max(1, max n_bow).

    The buffer is viewed as fp16 and then as overlapping windows of d_cls / d_bow
    elements (a strided view, no copy), so one index per vector, not per element, picks
    the rows: the index array is n x L, not n x L x d_bow.
    """
    d_cls, d_bow = layout.d_cls, layout.d_bow
    if isinstance(buffer, np.ndarray):
        flat_u8 = torch.from_numpy(buffer)
    else:
        flat_u8 = buffer
    flat_u8 = flat_u8[: flat_u8.numel() - flat_u8.numel() % 2]
    flat = flat_u8.view(torch.float16)
    device = flat.device
    n = len(starts)
    counts = torch.from_numpy(np.asarray(n_bow, dtype=np.int64)).to(device)
    first = torch.from_numpy(np.asarray(starts, dtype=np.int64) // 2).to(device)
    max_bow = int(np.max(n_bow)) if n else 0
    length = max(1, max_bow)

    cls = flat.unfold(0, d_cls, 1)[first]  # [n, d_cls]
    mask = torch.arange(length, device=device)[None, :] < counts[:, None]  # [n, L]
    if max_bow == 0:
        bow = torch.zeros((n, length, d_bow), dtype=torch.float16, device=device)
    else:
        rows = first[:, None] + d_cls + torch.arange(length, device=device)[None, :] * d_bow
        # Padding positions may point past the buffer: send them to row 0, zero them below.
        rows = torch.where(mask, rows, torch.zeros((), dtype=rows.dtype, device=device))
        bow = flat.unfold(0, d_bow, 1)[rows]  # [n, L, d_bow]
        bow.masked_fill_(~mask[:, :, None], 0)
    return cls, bow, mask
