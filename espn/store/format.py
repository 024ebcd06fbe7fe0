"""The embedding file: block-aligned records of one document's CLS and BOW vectors.

The storage types (`StoreLayout.dtype`, the manifest's `store.dtype`):

- ``float16``: `[CLS: d_cls x fp16][BOW: n x d_bow x fp16]` (format 1, every older index).
- ``int8``: `[scales: (1 + n) x fp16][CLS: d_cls x int8][BOW: n x d_bow x int8]`, padded to
  an even length. Each vector has its own scale (absmax / 127, rounded up in fp16, so no
  code clips): element error <= scale / 2. Per-vector beat per-dimension scales on SciFact
  (dot-product error rms 0.00097 against 0.00136) and needs no fitted state, so a delta
  segment written later decodes the same way. Half the bytes of fp16, plus 2 per vector.
- ``residual2`` / ``residual4``: `[CLS: d_cls x fp16][centroid ids: n x int32][codes: n x
  d_bow x bits / 8]`, padded to an even length: each BOW vector as its nearest first-stage
  centroid plus a 2- or 4-bit residual per dimension (`espn.store.residual`). The layout
  then carries the codec (`StoreLayout.codec`), which readers decode with.

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

from ..choices import STORAGE_TYPES as CHOICES_OF_STORAGE
from ..errors import IndexCorruptError, InvalidParameterError
from ..pooling.cluster import pool_documents_grouped
from ..pooling.groups import PoolGroupsWriter
from .residual import ID_BYTES, ResidualCodec, residual_bits

__all__ = [
    "RECORD_DTYPE",
    "STORAGE_DTYPE",
    "STORAGE_TYPES",
    "StoreLayout",
    "quantize_int8",
    "dequantize_int8",
    "stored_cls",
    "split_records",
    "decode_residual_rows",
    "record_nbytes",
    "place_records",
    "RecordWriter",
]

#: One row of records.npy.
RECORD_DTYPE = np.dtype([("offset", "<i8"), ("length", "<i8"), ("n_bow", "<i4")])
#: Dtype of the float16 records (and of the int8 records' scales).
STORAGE_DTYPE = np.dtype("<f2")
#: What `StoreLayout.dtype` (manifest `store.dtype`) may be.
STORAGE_TYPES = CHOICES_OF_STORAGE
DEFAULT_BLOCK_SIZE = 4096
#: Largest int8 code: codes lie in [-127, 127], symmetric around 0.
INT8_MAX = 127


@dataclasses.dataclass(frozen=True)
class StoreLayout:
    """Shape of the records: what a reader needs besides records.npy.

    dtype: how vectors are stored (STORAGE_TYPES); pool_factor: the writer pools each
    document's BOW vectors by this factor (1 = one stored vector per encoder vector);
    codec: what residual records decode with (attached by `from_manifest` given the index
    directory, once its centroids exist; not compared, and written to the manifest as
    `store.residual`).
    """

    d_cls: int
    d_bow: int
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: str = "float16"
    pool_factor: int = 1
    codec: ResidualCodec | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.block_size < 512 or self.block_size & (self.block_size - 1):
            raise InvalidParameterError(f"block_size must be a power of two >= 512, got {self.block_size}")
        if self.dtype not in STORAGE_TYPES:
            raise InvalidParameterError(f"dtype must be one of {', '.join(STORAGE_TYPES)}, got {self.dtype!r}")
        if not isinstance(self.pool_factor, int) or self.pool_factor < 1:
            raise InvalidParameterError(f"pool_factor must be an integer >= 1, got {self.pool_factor!r}")
        if self.bits and (self.d_bow * self.bits) % 8:
            raise InvalidParameterError(f"{self.dtype} records need d_bow x {self.bits} to be a whole number of "
                                        f"bytes; d_bow is {self.d_bow}")
        if self.codec is not None and (self.codec.bits != self.bits or self.codec.dim != self.d_bow):
            raise IndexCorruptError(f"the residual codec ({self.codec.bits} bits, {self.codec.dim}-d) does not fit "
                                    f"{self.dtype} records of {self.d_bow}-d vectors")

    @property
    def bits(self) -> int:
        """Bits per dimension of residual records; 0 for the others."""
        return residual_bits(self.dtype)

    def with_codec(self, codec: ResidualCodec | None) -> "StoreLayout":
        """This layout with its residual codec attached."""
        return dataclasses.replace(self, codec=codec)

    def require_codec(self) -> ResidualCodec:
        """The codec residual records decode with (a layout read from a manifest has none yet)."""
        if self.codec is None:
            raise IndexCorruptError(f"{self.dtype} records need their codec (first_stage/residual_*.npy), "
                                    "which was not loaded")
        return self.codec

    @classmethod
    def from_manifest(cls, store: Mapping[str, Any], directory: Path | None = None) -> "StoreLayout":
        """The layout of a manifest's `store` section (format 1 indexes: fp16, unpooled); given the
        index `directory`, residual records come with their codec (its first_stage/)."""
        dtype = store.get("dtype", "float16")
        if dtype not in STORAGE_TYPES:
            raise IndexCorruptError(f"the index stores vectors as {dtype!r}; this espn reads "
                                    f"{', '.join(STORAGE_TYPES)} (upgrade espn or rebuild the index)")
        layout = cls(int(store["d_cls"]), int(store["d_bow"]), int(store["block_size"]), dtype,
                     int(store.get("pool_factor", 1)))
        if layout.bits and directory is not None:
            return layout.with_codec(ResidualCodec.open(Path(directory) / "first_stage", dtype, store.get("residual")))
        return layout

    def manifest(self) -> dict[str, Any]:
        """The manifest's `store` fields that describe this layout."""
        section = {"dtype": self.dtype, "block_size": self.block_size, "d_cls": self.d_cls, "d_bow": self.d_bow,
                   "pool_factor": self.pool_factor, "scale": "per_vector" if self.dtype == "int8" else None}
        if self.codec is not None:
            section["residual"] = self.codec.manifest()
        return section


def record_nbytes(n_bow: np.ndarray | int, layout: StoreLayout) -> np.ndarray | int:
    """Byte length of a record holding `n_bow` BOW vectors (always even)."""
    n = np.asarray(n_bow, dtype=np.int64)
    if layout.dtype == "int8":
        raw = (1 + n) * STORAGE_DTYPE.itemsize + layout.d_cls + n * layout.d_bow
        return raw + raw % 2
    if layout.bits:
        raw = layout.d_cls * STORAGE_DTYPE.itemsize + n * (ID_BYTES + layout.d_bow * layout.bits // 8)
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


def stored_cls(cls: np.ndarray, layout: StoreLayout) -> np.ndarray:
    """[n, d_cls] float32: the CLS vectors as records of `layout` store them, as a reader decodes
    them. Every IVF is built from these (a build, a delta, a rewrite), so one that is fitted again
    from the records finds what a fresh build of the same documents found."""
    if layout.dtype == "int8":
        codes, scales = quantize_int8(cls)
        return dequantize_int8(torch.from_numpy(codes), torch.from_numpy(scales.view(np.float16))).float().numpy()
    return np.asarray(cls, dtype=STORAGE_DTYPE).astype(np.float32)


def split_records(buffer: torch.Tensor, starts: np.ndarray, n_bow: np.ndarray, layout: StoreLayout
                  ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """The stored values of records in one byte buffer, as they are stored (not decoded).

    buffer: 1-D uint8 tensor (any device); starts [n] even byte positions; n_bow [n].
    Returns cls [n, d_cls] and bow [sum n_bow, d_bow] (each document's vectors in turn), int8
    codes with their fp16 scales cls_scales [n] and bow_scales [sum n_bow] for int8 records,
    fp16 values and None for float16 ones, the decoded float32 vectors and None for residual
    ones. One index_select per tensor, over strided views of the buffer (one index per vector,
    not per element).
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

    if layout.bits:  # residual records: decoded here (their codes are not values to multiply)
        return (rows(flat16.unfold(0, d_cls, 1), first), None,
                decode_residual_rows(buffer, 2 * (first + d_cls), n_bow, layout), None)
    if layout.dtype != "int8":
        return (rows(flat16.unfold(0, d_cls, 1), first), None,
                rows(flat16.unfold(0, d_bow, 1), np.repeat(first + d_cls, n_bow) + within * d_bow), None)
    codes = buffer.view(torch.int8)
    cls_byte = 2 * (first + 1 + n_bow)  # the CLS codes follow the record's 1 + n scales
    return (rows(codes.unfold(0, d_cls, 1), cls_byte), rows(flat16, first),
            rows(codes.unfold(0, d_bow, 1), np.repeat(cls_byte + d_cls, n_bow) + within * d_bow),
            rows(flat16, np.repeat(first + 1, n_bow) + within))


def decode_residual_rows(buffer: torch.Tensor, bow_starts: np.ndarray, n_bow: np.ndarray,
                         layout: StoreLayout) -> torch.Tensor:
    """The BOW vectors [sum n_bow, d_bow] float32 of residual records, decoded on the buffer's device.

    buffer: 1-D uint8 tensor; bow_starts [n]: the byte where each record's centroid ids begin.
    One index_select for the ids and one for the codes (windows of the buffer), then one decode.
    """
    codec = layout.require_codec()
    n_bow = np.asarray(n_bow, dtype=np.int64)
    total = int(n_bow.sum())
    if total == 0:
        return torch.zeros((0, layout.d_bow), dtype=torch.float32, device=buffer.device)
    ends = np.cumsum(n_bow)
    within = np.arange(total, dtype=np.int64) - np.repeat(ends - n_bow, n_bow)
    starts = np.repeat(np.asarray(bow_starts, dtype=np.int64), n_bow)
    id_at = torch.from_numpy(starts + within * ID_BYTES).to(buffer.device)
    code_at = torch.from_numpy(starts + np.repeat(n_bow, n_bow) * ID_BYTES + within * codec.code_bytes)
    ids = buffer.unfold(0, ID_BYTES, 1).index_select(0, id_at).contiguous().view(torch.int32).reshape(-1)
    codes = buffer.unfold(0, codec.code_bytes, 1).index_select(0, code_at.to(buffer.device))
    return codec.decode_torch(ids, codes)


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
        elif lay.bits:
            ids, codes = lay.require_codec().encode(bow.reshape(-1, lay.d_bow))
            cls16 = np.ascontiguousarray(cls, dtype=STORAGE_DTYPE)
            for i in range(len(counts)):
                a, b = int(bow_starts[i]), int(bow_ends[i])
                at = _put(buf, int(rel[i]), cls16[i].view(np.uint8))
                at = _put(buf, at, ids[a:b].astype("<i4").view(np.uint8))
                _put(buf, at, codes[a:b].reshape(-1))
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

    def append_stored(self, blob: np.ndarray, lengths: np.ndarray, n_bow: np.ndarray) -> np.ndarray:
        """Write records already stored as this layout stores them (bytes copied as they are, never
        decoded and coded again: no rounding twice); returns their rows of records.npy.

        blob: the records' bytes one after the other [sum(lengths)] uint8; n_bow their vector counts."""
        lengths = np.asarray(lengths, dtype=np.int64)
        offsets, end = place_records(lengths, self.layout.block_size, self.position)
        buf = np.zeros(end - self.position, dtype=np.uint8)
        sources = np.cumsum(lengths) - lengths
        gather = np.repeat(offsets - self.position - sources, lengths) + np.arange(int(lengths.sum()))
        buf[gather] = blob
        self._file.write(buf.tobytes())
        self.position = end
        rows = np.empty(len(lengths), dtype=RECORD_DTYPE)
        rows["offset"], rows["length"], rows["n_bow"] = offsets, lengths, n_bow
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
