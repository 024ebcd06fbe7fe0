"""Documents encoded in memory for a write: what the writer stores as a delta segment.

`encode_documents` is the online path (a few documents, this thread, no corpus or chunk
files); the offline build (espn_indexing.encode) encodes a corpus through a DataLoader and
shares `reorder_chunk` with it, so a write and a build of the same text store the same records.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from espn.corpus import PASSAGE_JOINER, passage_line, passage_text
from espn.encoders import DocumentEmbeddings, Encoder

__all__ = ["EncodedDocuments", "encode_documents", "reorder_chunk"]


@dataclasses.dataclass
class EncodedDocuments:
    """Documents encoded in memory, ready to become a delta segment.

    ids [n] external ids; lines [n] their docs.jsonl lines (utf-8); cls [n, d_cls] and
    bow [sum(counts), d_bow] float16, as the build's chunk files store them (so a write
    and a build of the same text store the same records); counts [n] int32.
    """

    ids: list[str]
    lines: list[bytes]
    cls: np.ndarray
    bow: np.ndarray
    counts: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, rows: Sequence[int]) -> "EncodedDocuments":
        """The documents at `rows`, in that order."""
        picked = np.asarray(rows, dtype=np.int64)
        counts = np.asarray(self.counts, dtype=np.int64)
        starts = np.cumsum(counts) - counts
        lengths = counts[picked]
        gather = np.repeat(starts[picked] - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
        return EncodedDocuments([self.ids[i] for i in picked], [self.lines[i] for i in picked], self.cls[picked],
                                self.bow[gather], self.counts[picked])

    @classmethod
    def concat(cls, parts: Sequence["EncodedDocuments"]) -> "EncodedDocuments":
        return cls([i for p in parts for i in p.ids], [line for p in parts for line in p.lines],
                   np.concatenate([p.cls for p in parts]), np.concatenate([p.bow for p in parts]),
                   np.concatenate([p.counts for p in parts]))


def encode_documents(encoder: Encoder, documents: Sequence[tuple[str, str, str, Mapping[str, Any] | None]],
                     batch_size: int = 32, joiner: str = PASSAGE_JOINER) -> EncodedDocuments:
    """Encode (id, title, text, metadata) documents in this thread, in memory: the online write
    path (no corpus or chunk files). Batches are bucketed by length as in the build; a title
    joins its text with `joiner`, the index's (`espn.corpus.index_title_joiner`)."""
    texts = [passage_text(title, text, joiner) for _, title, text, _ in documents]
    order = encoder.batch_order(texts)
    parts = []
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        embeddings = encoder.embed_documents(encoder.tokenize([texts[i] for i in rows], is_query=False))
        parts.append((np.asarray(rows, dtype=np.int64), embeddings))
    chunk = reorder_chunk(parts)
    lines = [passage_line(title, text, dict(metadata) if metadata else None).encode("utf-8")
             for _, title, text, metadata in documents]
    return EncodedDocuments([doc_id for doc_id, _, _, _ in documents], lines,
                            np.ascontiguousarray(chunk.cls, dtype=np.float16),
                            np.ascontiguousarray(chunk.bow, dtype=np.float16), chunk.counts.astype(np.int32))


def reorder_chunk(parts: list[tuple[np.ndarray, DocumentEmbeddings]]) -> DocumentEmbeddings:
    """Undo the length bucketing: batches in bucket order -> documents in corpus order."""
    rows = np.concatenate([r for r, _ in parts])
    cls = np.concatenate([e.cls for _, e in parts])
    bow = np.concatenate([e.bow for _, e in parts])
    counts = np.concatenate([e.counts for _, e in parts]).astype(np.int64)
    starts = np.cumsum(counts) - counts
    inverse = np.argsort(rows, kind="stable")
    new_counts = counts[inverse]
    # Row ids of each document's BOW vectors, in corpus order, without a Python loop over documents.
    offsets = np.repeat(starts[inverse] - (np.cumsum(new_counts) - new_counts), new_counts)
    gather = np.arange(int(new_counts.sum())) + offsets
    return DocumentEmbeddings(cls=cls[inverse], bow=bow[gather], counts=new_counts.astype(np.int32))
