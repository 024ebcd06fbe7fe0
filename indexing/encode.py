"""Encode stage: corpus -> chunk files, tokenised in a DataLoader worker, the model in this process.

The worker process streams the corpus, cuts it into chunks, buckets each chunk's
documents by length (little padding) and tokenises them; the main process only
feeds the model and writes chunk files. Chunks that already exist are skipped, so
a re-run after a crash resumes, and `shard`/`num_shards` split chunks round-robin
between processes (one per GPU on a GPU machine).
"""

from __future__ import annotations

import logging
import os
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset
from tqdm import tqdm

from espn.corpus import CorpusDocument, iter_corpus
from espn.encoders import DocumentEmbeddings, Encoder

from .chunks import finished_chunks, write_chunk

__all__ = ["encode_corpus", "read_sample", "reorder_chunk"]

log = logging.getLogger(__name__)


def read_sample(corpus: Path, count: int, skip_bad: bool) -> list[str]:
    """The first `count` documents' text: the sample a projection is fitted on (deterministic)."""
    return [doc.full_text for doc in islice(iter_corpus(corpus, skip_bad=skip_bad), count)]


class _TokenisedChunks(IterableDataset):
    """Yields one dict per batch; the last item carries the corpus totals."""

    def __init__(self, corpus: Path, encoder: Encoder, chunk_size: int, batch_size: int,
                 shard: int, num_shards: int, done: frozenset[int], skip_bad: bool) -> None:
        self.corpus, self.encoder = corpus, encoder
        self.chunk_size, self.batch_size = chunk_size, batch_size
        self.shard, self.num_shards, self.done, self.skip_bad = shard, num_shards, done, skip_bad

    def _chunks(self) -> Iterator[tuple[int, list[CorpusDocument]]]:
        docs = iter_corpus(self.corpus, skip_bad=self.skip_bad)
        for index in range(1 << 62):
            chunk = list(islice(docs, self.chunk_size))
            if not chunk:
                return
            yield index, chunk

    def __iter__(self) -> Iterator[dict[str, Any]]:
        total_docs = total_chunks = 0
        for index, chunk in self._chunks():
            total_docs += len(chunk)
            total_chunks = index + 1
            if index % self.num_shards != self.shard or index in self.done:
                continue
            texts = [doc.full_text for doc in chunk]
            order = sorted(range(len(texts)), key=lambda i: self.encoder.text_length(texts[i]))
            starts = range(0, len(order), self.batch_size)
            for number, start in enumerate(starts):
                rows = order[start : start + self.batch_size]
                yield {
                    "chunk": index,
                    "rows": np.asarray(rows, dtype=np.int64),
                    "tokens": self.encoder.tokenize([texts[i] for i in rows], is_query=False),
                    "last": number == len(starts) - 1,
                    "meta": [(d.doc_id, d.title, d.text) for d in chunk] if number == 0 else None,
                }
        yield {"end": True, "documents": total_docs, "chunks": total_chunks}


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


def encode_corpus(corpus: Path, work_dir: Path, encoder: Encoder, *, chunk_size: int = 1024, batch_size: int = 32,
                  shard: int = 0, num_shards: int = 1, skip_bad: bool = False, loader_workers: int = 1,
                  progress: bool = True) -> dict[str, int]:
    """Write this shard's missing chunk files; returns {"documents": N, "chunks": C} of the whole corpus."""
    done = frozenset(finished_chunks(work_dir))
    dataset = _TokenisedChunks(corpus, encoder, chunk_size, batch_size, shard, num_shards, done, skip_bad)
    cuda = torch.cuda.is_available() and str(getattr(encoder, "device", "cpu")).startswith("cuda")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # fast tokenizers deadlock-warn after fork
    loader = DataLoader(dataset, batch_size=None, num_workers=loader_workers, pin_memory=cuda,
                        prefetch_factor=4 if loader_workers else None, persistent_workers=False)
    pending: dict[int, dict[str, Any]] = {}
    totals = {"documents": 0, "chunks": 0}
    with tqdm(unit="doc", unit_scale=True, desc=f"encode shard {shard}/{num_shards}", disable=not progress,
              mininterval=1.0) as bar:
        for item in loader:
            if item.get("end"):
                totals = {"documents": int(item["documents"]), "chunks": int(item["chunks"])}
                break
            state = pending.setdefault(int(item["chunk"]), {"parts": [], "meta": None})
            if item["meta"] is not None:
                state["meta"] = item["meta"]
            embeddings = encoder.embed_documents(item["tokens"])
            state["parts"].append((np.asarray(item["rows"]), embeddings))
            bar.update(len(item["rows"]))
            if item["last"]:
                index = int(item["chunk"])
                chunk = reorder_chunk(pending.pop(index)["parts"])
                ids, titles, texts = zip(*state["meta"])
                assert len(chunk) == len(ids)
                write_chunk(work_dir, index, chunk.cls, chunk.bow, chunk.counts, ids, titles, texts)
                log.debug("chunk %d written (%d documents)", index, len(ids))
    return totals
