"""The embedding file: block-aligned records of one document's CLS and BOW vectors.

Two storage types (`StoreLayout.dtype`, the manifest's `store.dtype`):

- ``float16``: `[CLS: d_cls x fp16][BOW: n x d_bow x fp16]` (format 1, every older index).
- ``int8``: `[scales: (1 + n) x fp16][CLS: d_cls x int8][BOW: n x d_bow x int8]`, padded to
  an even length. Each vector has its own scale (absmax / 127, rounded up in fp16, so no
  code clips): element error <= scale / 2. Per-vector beat per-dimension scales on SciFact
  (dot-product error rms 0.00097 against 0.00136) and needs no fitted state, so a delta
  segment written later decodes the same way. Half the bytes of fp16, plus 2 per vector.

With `pool_factor` F > 1 the writer pools each document's BOW vectors to about n / F
(`espn.pooling.cluster`) before storing them; readers need not know. Given a `groups_dir` it
records which encoder vectors each stored vector merged (`espn.pooling.groups`), for
explanations.

A record never straddles a block boundary needlessly: it starts where the last one ended
unless that would make it span more blocks than its length needs, in which case it starts
on the next boundary. So a record of at most one block is one aligned I/O, several small
records share a block, and a larger one spans the fewest blocks. The file is padded to a
whole number of blocks so that `O_DIRECT` reads of the last block are full reads.
`records.npy` gives each record's offset, byte length and number of BOW vectors; the zero
padding between records is never scored.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import IO, Any, Mapping

import numpy as np
import torch

from ..errors import IndexCorruptError, InvalidParameterError
from ..pooling.cluster import pool_documents_grouped
from ..pooling.groups import PoolGroupsWriter

__all__ = [
    "RECORD_DTYPE",
    "STORAGE_DTYPE",
    "STORAGE_TYPES",
    "StoreLayout",
    "quantize_int8",
    "dequantize_int8",
    "split_records",
    "record_nbytes",
    "place_records",
    "RecordWriter",
]

#: One row of records.npy.
RECORD_DTYPE = np.dtype([("offset", "<i8"), ("length", "<i8"), ("n_bow", "<i4")])
#: Dtype of the float16 records (and of the int8 records' scales).
STORAGE_DTYPE = np.dtype("<f2")
#: What `StoreLayout.dtype` (manifest `store.dtype`) may be.
STORAGE_TYPES = ("float16", "int8")
DEFAULT_BLOCK_SIZE = 4096
#: Largest int8 code: codes lie in [-127, 127], symmetric around 0.
INT8_MAX = 127


@dataclasses.dataclass(frozen=True)
class StoreLayout:
    """Shape of the records: what a reader needs besides records.npy.

    dtype: how vectors are stored ("float16" or "int8"); pool_factor: the writer pools each
    document's BOW vectors by this factor (1 = one stored vector per encoder vector).
    """

    d_cls: int
    d_bow: int
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: str = "float16"
    pool_factor: int = 1

    def __post_init__(self) -> None:
        if self.block_size < 512 or self.block_size & (self.block_size - 1):
            raise InvalidParameterError(f"block_size must be a power of two >= 512, got {self.block_size}")
        if self.dtype not in STORAGE_TYPES:
            raise InvalidParameterError(f"dtype must be one of {', '.join(STORAGE_TYPES)}, got {self.dtype!r}")
        if not isinstance(self.pool_factor, int) or self.pool_factor < 1:
            raise InvalidParameterError(f"pool_factor must be an integer >= 1, got {self.pool_factor!r}")

    @classmethod
    def from_manifest(cls, store: Mapping[str, Any]) -> "StoreLayout":
        """The layout of a manifest's `store` section (format 1 indexes: fp16, unpooled)."""
        dtype = store.get("dtype", "float16")
        if dtype not in STORAGE_TYPES:
            raise IndexCorruptError(f"the index stores vectors as {dtype!r}; this espn reads "
                                    f"{', '.join(STORAGE_TYPES)} (upgrade espn or rebuild the index)")
        return cls(int(store["d_cls"]), int(store["d_bow"]), int(store["block_size"]), dtype,
                   int(store.get("pool_factor", 1)))

    def manifest(self) -> dict[str, Any]:
        """The manifest's `store` fields that describe this layout."""
        return {"dtype": self.dtype, "block_size": self.block_size, "d_cls": self.d_cls, "d_bow": self.d_bow,
                "pool_factor": self.pool_factor, "scale": "per_vector" if self.dtype == "int8" else None}


def record_nbytes(n_bow: np.ndarray | int, layout: StoreLayout) -> np.ndarray | int:
    """Byte length of a record holding `n_bow` BOW vectors (always even)."""
    n = np.asarray(n_bow, dtype=np.int64)
    if layout.dtype == "int8":
        raw = (1 + n) * STORAGE_DTYPE.itemsize + layout.d_cls + n * layout.d_bow
        return raw + raw % 2
    return (layout.d_cls + n * layout.d_bow) * STORAGE_DTYPE.itemsize


def place_records(lengths: np.ndarray, block_size: int, start: int = 0) -> tuple[np.ndarray, int]:
    """Offsets for records of `lengths` bytes appended at byte `start`.

    A record goes where the previous one ended if it spans no more blocks from there than
    its length needs (ceil(length / block_size)), else on the next block boundary.
    Returns (offsets [n] int64, end) where `end` is the first free byte after them.
    The loop is over records of one chunk, not the corpus.

    >>> place_records(np.array([1000, 3500, 5000, 5000]), 4096)[0].tolist()
    [0, 4096, 8192, 13192]
    """
    offsets = np.empty(len(lengths), dtype=np.int64)
    pos = int(start)
    for i, length in enumerate(lengths.tolist()):
        used = pos % block_size
        needed = max(1, -(-length // block_size))
        if used and -(-(used + length) // block_size) > needed:
            pos += block_size - used
        offsets[i] = pos
        pos += length
    return offsets, pos


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-vector symmetric int8: x [n, d] float -> (codes [n, d] int8, scales [n] float16).

    scale = absmax / 127 rounded up to the next fp16, so |x - codes * scale| <= scale / 2
    element-wise and no code clips; a zero vector gets scale 0 and codes 0.
    """
    x = np.asarray(x, dtype=np.float32)
    absmax = np.abs(x).max(axis=1) if x.size else np.zeros(len(x), np.float32)
    scales = (absmax / INT8_MAX).astype(STORAGE_DTYPE)
    low = scales.astype(np.float32) * INT8_MAX < absmax  # fp16 rounded down: step up once
    scales[low] = np.nextafter(scales[low], np.float16(np.inf))
    if not np.all(np.isfinite(scales)):
        raise InvalidParameterError("vectors hold NaN, infinity or values beyond float16; cannot store them as int8")
    wide = scales.astype(np.float32)
    safe = np.where(wide > 0, wide, 1.0)
    codes = np.clip(np.rint(x / safe[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """codes [n, d] int8 x scales [n] (fp16) -> [n, d] float16, on the tensors' device.

    On a GPU this runs where MaxSim runs, on the bytes the read brought: only int8 crosses
    the bus. Computed in fp32, rounded once to fp16.
    """
    decoded = codes.to(torch.float32) * scales.to(torch.float32)[:, None]
    if out is None:
        return decoded.to(torch.float16)
    return out.copy_(decoded)


def split_records(buffer: torch.Tensor, starts: np.ndarray, n_bow: np.ndarray, layout: StoreLayout
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """The stored values of records in one byte buffer, as they are stored (not decoded).

    buffer: 1-D uint8 tensor (any device); starts [n] even byte positions; n_bow [n].
    Returns cls [n, d_cls] and bow [sum n_bow, d_bow] (each document's vectors in turn), int8
    codes with their fp16 scales cls_scales [n] and bow_scales [sum n_bow] for int8 records,
    fp16 values and None for float16 ones. One index_select per tensor, over strided views
    of the buffer (one index per vector, not per element).
    """
    d_cls, d_bow = layout.d_cls, layout.d_bow
    device = buffer.device
    flat16 = buffer[: buffer.numel() - buffer.numel() % 2].view(torch.float16)
    n_bow = np.asarray(n_bow, dtype=np.int64)
    first = np.asarray(starts, dtype=np.int64) // 2  # the fp16 element where each record starts
    offsets = np.zeros(len(n_bow) + 1, dtype=np.int64)
    np.cumsum(n_bow, out=offsets[1:])
    within = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], n_bow)

    def rows(view: torch.Tensor, at: np.ndarray) -> torch.Tensor:
        return view.index_select(0, torch.from_numpy(at).to(device))

    if layout.dtype != "int8":
        return (rows(flat16.unfold(0, d_cls, 1), first), None,
                rows(flat16.unfold(0, d_bow, 1), np.repeat(first + d_cls, n_bow) + within * d_bow), None)
    codes = buffer.view(torch.int8)
    cls_byte = 2 * (first + 1 + n_bow)  # the CLS codes follow the record's 1 + n scales
    return (rows(codes.unfold(0, d_cls, 1), cls_byte), rows(flat16, first),
            rows(codes.unfold(0, d_bow, 1), np.repeat(cls_byte + d_cls, n_bow) + within * d_bow),
            rows(flat16, np.repeat(first + 1, n_bow) + within))


class RecordWriter:
    """Appends records to embeddings.bin; resumable from a byte position.

    Stores vectors as `layout.dtype` and pools BOW vectors by `layout.pool_factor`: every
    writer of records (the build, delta segments) goes through here, so they all agree
    with the manifest. Not thread-safe; one writer per file. `close()` pads the file to
    whole blocks and fsyncs it.

    groups_dir: where the pooling groups of the documents this writer pools go
    (`espn.pooling.groups`: the build's staging directory, a delta segment's); written at
    `close()`, nothing when the layout does not pool.
    """

    def __init__(self, path: Path, layout: StoreLayout, resume_at: int = 0, groups_dir: Path | None = None) -> None:
        self.layout = layout
        self.path = Path(path)
        self._groups = PoolGroupsWriter(groups_dir) if groups_dir is not None and layout.pool_factor > 1 else None
        mode = "r+b" if resume_at and self.path.exists() else "wb"
        self._file: IO[bytes] = open(self.path, mode)
        self._file.truncate(resume_at)
        self._file.seek(resume_at)
        self.position = resume_at

    def append(self, cls: np.ndarray, bow: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Write one chunk of documents; returns its rows of records.npy.

        cls [n, d_cls], bow [sum(counts), d_bow], counts [n]; any float dtype. With a pool
        factor above 1 the rows' `n_bow` are the pooled counts.
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
        if lay.pool_factor > 1:
            source_counts = counts
            bow, counts, groups = pool_documents_grouped(bow, counts, lay.pool_factor)
            if self._groups is not None:
                self._groups.append(groups, source_counts)
        lengths = np.asarray(record_nbytes(counts, lay))
        offsets, end = place_records(lengths, lay.block_size, self.position)

        # Assemble the chunk's bytes in one buffer, then one write.
        buf = np.zeros(end - self.position, dtype=np.uint8)
        bow_ends = np.cumsum(counts)
        bow_starts = bow_ends - counts
        rel = offsets - self.position
        if lay.dtype == "int8":
            cls_codes, cls_scales = quantize_int8(cls)
            bow_codes, bow_scales = quantize_int8(bow.reshape(-1, lay.d_bow))
            for i in range(len(counts)):
                a, b, at = int(bow_starts[i]), int(bow_ends[i]), int(rel[i])
                scales = np.concatenate([cls_scales[i: i + 1], bow_scales[a:b]]).view(np.uint8)
                body = bow_codes[a:b].reshape(-1).view(np.uint8)
                at = _put(buf, at, scales)
                at = _put(buf, at, cls_codes[i].view(np.uint8))
                _put(buf, at, body)
        else:
            cls16 = np.ascontiguousarray(cls, dtype=STORAGE_DTYPE)
            bow16 = np.ascontiguousarray(bow, dtype=STORAGE_DTYPE)
            for i in range(len(counts)):
                at = _put(buf, int(rel[i]), cls16[i].view(np.uint8))
                _put(buf, at, bow16[bow_starts[i] : bow_ends[i]].reshape(-1).view(np.uint8))
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
        if self._groups is not None:
            self._groups.finish()
            self._groups = None
        return self.position

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._file.closed:
            self._file.close()
        if self._groups is not None:  # closed without close(): the groups of a failed write go
            self._groups.abort()
            self._groups = None


def _put(buf: np.ndarray, at: int, data: np.ndarray) -> int:
    """Copy bytes into buf at `at`; returns the position after them."""
    buf[at : at + data.size] = data
    return at + data.size
