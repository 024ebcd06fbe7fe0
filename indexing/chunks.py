"""Chunk files: the unit of work, resume and parallelism of the build job.

A chunk is a run of consecutive documents (chunk c holds documents
c*chunk_size .. (c+1)*chunk_size-1 of the corpus order). Encoders and the
precomputed-embeddings importer both write chunks; the assembler reads them in
order. A chunk file appears only once complete (written under a temporary
name, then `os.replace`), so a crash leaves either a whole chunk or none.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from espn.corpus import passage_line

__all__ = ["Chunk", "chunk_path", "write_chunk", "read_chunk", "finished_chunks", "pack_strings", "pack_bytes", "unpack_strings",
           "passage_line"]


class Chunk:
    """Embeddings and metadata of one chunk; arrays as stored (fp16 vectors)."""

    __slots__ = ("index", "cls", "bow", "counts", "ids", "docs_blob", "docs_offsets", "images_blob",
                 "images_offsets", "grids")

    def __init__(self, index: int, cls: np.ndarray, bow: np.ndarray, counts: np.ndarray,
                 ids: np.ndarray, docs_blob: np.ndarray, docs_offsets: np.ndarray,
                 images_blob: np.ndarray | None = None, images_offsets: np.ndarray | None = None,
                 grids: np.ndarray | None = None) -> None:
        self.index = index
        self.cls, self.bow, self.counts = cls, bow, counts
        self.ids = ids  # [n] bytes ('S') array of utf-8 external ids
        self.docs_blob, self.docs_offsets = docs_blob, docs_offsets  # JSON lines of {title, text}
        # A page chunk's stored images (espn.pages.images), back to back, offsets [n + 1]; None: text
        self.images_blob, self.images_offsets = images_blob, images_offsets
        self.grids = grids  # a page chunk's patch grids [n, 4] (espn.pages.grids); None: text, or not kept

    def __len__(self) -> int:
        return len(self.counts)

    def select(self, keep: np.ndarray) -> "Chunk":
        """The documents where `keep` [n] bool is True, as a new chunk (for index partitions)."""
        bow_rows = np.repeat(keep, self.counts)
        texts = unpack_strings(self.docs_blob, self.docs_offsets)
        blob, offsets = pack_strings([t for t, k in zip(texts, keep) if k])
        images_blob = images_offsets = None
        if self.images_blob is not None and self.images_offsets is not None:
            raw = self.images_blob.tobytes()
            images_blob, images_offsets = pack_bytes([raw[a:b] for a, b, k in zip(
                self.images_offsets[:-1].tolist(), self.images_offsets[1:].tolist(), keep) if k])
        return Chunk(self.index, self.cls[keep], self.bow[bow_rows], self.counts[keep], self.ids[keep], blob, offsets,
                     images_blob, images_offsets, None if self.grids is None else self.grids[keep])


def chunk_path(work_dir: Path, index: int) -> Path:
    return Path(work_dir) / "chunks" / f"{index:07d}.npz"


def pack_strings(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """utf-8 blob [bytes] uint8 and offsets [n+1] int64: text without n Python objects later."""
    return pack_bytes([s.encode("utf-8") for s in strings])


def pack_bytes(encoded: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """blob [bytes] uint8 and offsets [n+1] int64 of byte strings back to back."""
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    blob = np.frombuffer(b"".join(encoded), dtype=np.uint8) if encoded else np.zeros(0, np.uint8)
    return blob, offsets


def unpack_strings(blob: np.ndarray, offsets: np.ndarray) -> list[str]:
    raw = blob.tobytes()
    return [raw[offsets[i] : offsets[i + 1]].decode("utf-8") for i in range(len(offsets) - 1)]


def write_chunk(work_dir: Path, index: int, cls: np.ndarray, bow: np.ndarray, counts: np.ndarray,
                ids: Sequence[str], titles: Sequence[str] | None = None, texts: Sequence[str] | None = None,
                metadata: Sequence[dict | None] | None = None, images: Sequence[bytes] | None = None,
                grids: np.ndarray | None = None,
                packed_images: tuple[np.ndarray, np.ndarray] | None = None) -> Path:
    """Write chunk `index` atomically. titles/texts may be None (precomputed embeddings).

    metadata: per document its metadata object or None; kept in the document's JSON line,
    from which the assembler builds the metadata columns. images: per page its stored image
    bytes (espn.pages.images.encode_page_image), for a page corpus; None for text; or
    packed_images: the same back to back (blob [bytes] uint8, offsets [n + 1] int64; a memory
    map is written in pieces, never copied whole). grids: the pages' patch grids [n, 4]
    (espn.pages.grids), for a page corpus.
    """
    n = len(counts)
    if len(cls) != n or len(ids) != n or int(np.sum(counts)) != len(bow):
        raise ValueError(f"chunk {index}: {len(cls)} CLS rows, {len(ids)} ids, {n} counts, {len(bow)} BOW rows disagree")
    titles = titles if titles is not None else [""] * n
    texts = texts if texts is not None else [""] * n
    metas = metadata if metadata is not None else [None] * n
    lines = [passage_line(t, x, m) for t, x, m in zip(titles, texts, metas)]
    docs_blob, docs_offsets = pack_strings(lines)
    extra: dict[str, Any] = {}  # Any: savez takes the arrays as keywords beside its own bool
    if images is not None:
        packed_images = pack_bytes(list(images))
    if packed_images is not None:
        blob, offsets = packed_images
        if len(offsets) != n + 1 or int(offsets[-1]) != len(blob):
            raise ValueError(f"chunk {index}: {len(offsets) - 1} images of {int(offsets[-1])} bytes for {n} "
                             f"documents and {len(blob)} bytes")
        extra["images_blob"], extra["images_offsets"] = blob, offsets
    if grids is not None:
        if np.shape(grids) != (n, 4):
            raise ValueError(f"chunk {index}: page grids of shape {np.shape(grids)} for {n} documents")
        extra["grids"] = np.asarray(grids, dtype=np.int32)
    path = chunk_path(work_dir, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(
            f,
            cls=np.ascontiguousarray(cls, dtype=np.float16),
            bow=np.ascontiguousarray(bow, dtype=np.float16),  # [sum(counts), d_bow]
            counts=np.asarray(counts, dtype=np.int32),
            ids=np.array([i.encode("utf-8") for i in ids], dtype=bytes) if n else np.zeros(0, dtype="S1"),
            docs_blob=docs_blob,
            docs_offsets=docs_offsets,
            **extra,
        )
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_chunk(work_dir: Path, index: int) -> Chunk:
    with np.load(chunk_path(work_dir, index), allow_pickle=False) as z:
        has_images = "images_blob" in z.files
        return Chunk(index, z["cls"], z["bow"], z["counts"], z["ids"], z["docs_blob"], z["docs_offsets"],
                     z["images_blob"] if has_images else None, z["images_offsets"] if has_images else None,
                     z["grids"] if "grids" in z.files else None)


def finished_chunks(work_dir: Path) -> Iterator[int]:
    """Indices of the chunk files present, in order."""
    folder = Path(work_dir) / "chunks"
    if not folder.is_dir():
        return iter(())
    return iter(sorted(int(p.stem) for p in folder.glob("*.npz")))
