"""The embedding file: block-aligned fp16 records `[CLS: d_cls][BOW: n x d_bow]`.

A record never straddles a block boundary needlessly: a record that does not fit in
what is left of the current block starts on the next boundary, so a record of at
most one block is one aligned I/O and a larger one spans the fewest blocks. The
file is padded to a whole number of blocks so that `O_DIRECT` reads of the last
block are full reads. `records.npy` gives each record's offset, byte length and
number of BOW vectors; the zero padding between records is never scored.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import IO

import numpy as np

__all__ = [
    "RECORD_DTYPE",
    "STORAGE_DTYPE",
    "StoreLayout",
    "record_nbytes",
    "place_records",
    "RecordWriter",
]

#: One row of records.npy.
RECORD_DTYPE = np.dtype([("offset", "<i8"), ("length", "<i8"), ("n_bow", "<i4")])
#: Dtype of every vector in embeddings.bin.
STORAGE_DTYPE = np.dtype("<f2")
DEFAULT_BLOCK_SIZE = 4096


@dataclasses.dataclass(frozen=True)
class StoreLayout:
    """Shape of the records: what a reader needs besides records.npy."""

    d_cls: int
    d_bow: int
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.block_size < 512 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 512, got {self.block_size}")


def record_nbytes(n_bow: np.ndarray | int, layout: StoreLayout) -> np.ndarray | int:
    """Byte length of a record holding `n_bow` BOW vectors."""
    return (layout.d_cls + np.asarray(n_bow, dtype=np.int64) * layout.d_bow) * STORAGE_DTYPE.itemsize


def place_records(lengths: np.ndarray, block_size: int, start: int = 0) -> tuple[np.ndarray, int]:
    """Offsets for records of `lengths` bytes appended at byte `start`.

    Returns (offsets [n] int64, end) where `end` is the first free byte after them.
    The loop is over records of one chunk, not the corpus.
    """
    offsets = np.empty(len(lengths), dtype=np.int64)
    pos = int(start)
    for i, length in enumerate(lengths.tolist()):
        used = pos % block_size
        if used and used + length > block_size:
            pos += block_size - used
        offsets[i] = pos
        pos += length
    return offsets, pos


class RecordWriter:
    """Appends records to embeddings.bin; resumable from a byte position.

    Not thread-safe; one writer per file. `close()` pads the file to whole blocks
    and fsyncs it.
    """

    def __init__(self, path: Path, layout: StoreLayout, resume_at: int = 0) -> None:
        self.layout = layout
        self.path = Path(path)
        mode = "r+b" if resume_at and self.path.exists() else "wb"
        self._file: IO[bytes] = open(self.path, mode)
        self._file.truncate(resume_at)
        self._file.seek(resume_at)
        self.position = resume_at

    def append(self, cls: np.ndarray, bow: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Write one chunk of documents; returns its rows of records.npy.

        cls [n, d_cls], bow [sum(counts), d_bow], counts [n]; any float dtype.
        """
        lay = self.layout
        if cls.shape[1] != lay.d_cls or (len(bow) and bow.shape[1] != lay.d_bow):
            raise ValueError(
                f"embedding dims {cls.shape[1]}/{bow.shape[1] if bow.ndim == 2 else '?'} "
                f"do not match the store's d_cls={lay.d_cls}, d_bow={lay.d_bow}"
            )
        counts = np.asarray(counts, dtype=np.int64)
        if len(cls) != len(counts) or len(bow) != int(counts.sum()):
            raise ValueError(f"{len(cls)} CLS rows and {len(bow)} BOW rows do not match counts (n={len(counts)}, "
                             f"sum={int(counts.sum())})")
        lengths = np.asarray(record_nbytes(counts, lay))
        offsets, end = place_records(lengths, lay.block_size, self.position)

        # Assemble the chunk's bytes in one buffer, then one write.
        buf = np.zeros(end - self.position, dtype=np.uint8)
        cls16 = np.ascontiguousarray(cls, dtype=STORAGE_DTYPE)
        bow16 = np.ascontiguousarray(bow, dtype=STORAGE_DTYPE)
        bow_ends = np.cumsum(counts)
        bow_starts = bow_ends - counts
        cls_bytes = lay.d_cls * STORAGE_DTYPE.itemsize
        for i in range(len(counts)):
            rel = int(offsets[i]) - self.position
            buf[rel : rel + cls_bytes] = cls16[i].view(np.uint8)
            body = bow16[bow_starts[i] : bow_ends[i]].reshape(-1).view(np.uint8)
            buf[rel + cls_bytes : rel + cls_bytes + body.size] = body
        self._file.write(buf.tobytes())
        self.position = end

        rows = np.empty(len(counts), dtype=RECORD_DTYPE)
        rows["offset"], rows["length"], rows["n_bow"] = offsets, lengths, counts
        return rows

    def close(self) -> int:
        """Pad to a whole block, flush and fsync; returns the file size."""
        pad = (-self.position) % self.layout.block_size
        if pad:
            self._file.write(b"\0" * pad)
            self.position += pad
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self.position

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._file.closed:
            self._file.close()
