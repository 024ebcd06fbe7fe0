"""Synthetic documents for the growth studies, drawn chunk by chunk around a real index's vectors.

A document number always gives the same document (each chunk of `CHUNK` documents has its own
seed), so an index grown by writes and a fresh build of its first N documents hold exactly the
same vectors, without the corpus ever being held whole in memory.

Two kinds (`benchmarks.make_synthetic` draws them the same way):

- "tokens": ColBERT-class documents. Around a ColBERT-class source index (SciFact through MiniLM
  saved as a PyLate checkpoint, `espn index --encoder colbert:...`): 128-d unit token vectors,
  each document as long as a random source document, its CLS the normalised mean of its tokens
  (the models have no trained CLS), pure MaxSim (w = 0). Queries: 32 token vectors (a ColBERT
  query with its expansion).
- "text": the default text model's documents. Around a MiniLM index whose token vectors are
  unprojected (384-d, what a created index stores): CLS vectors mixed from two real documents',
  tokens drawn from the first's, lengths from the source, w = 0.3 over CLS and mean MaxSim.
  Queries: 8..24 tokens (short questions).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from benchmarks.make_synthetic import draw, load_centres, mean_vectors

__all__ = ["CHUNK", "KINDS", "SyntheticCorpus"]

#: Documents per seeded chunk.
CHUNK = 1000
KINDS = ("tokens", "text")


@dataclasses.dataclass
class SyntheticCorpus:
    """Documents 0, 1, 2, ... of one kind around `source`'s vectors (see the module doc)."""

    source: Path
    kind: str = "tokens"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        manifest = json.loads((Path(self.source) / "manifest.json").read_text())["encoder"]
        if self.kind == "tokens":
            self.d_cls = self.d_bow = 128
            self.centres = load_centres(self.source, 128, 128, widen=True)
        else:  # the source's own space, as the model wrote it
            self.d_cls, self.d_bow = int(manifest["d_cls"]), int(manifest["d_bow"])
            self.centres = load_centres(self.source, self.d_cls, self.d_bow, project=False)

    @property
    def maxsim_only(self) -> bool:
        return self.kind == "tokens"

    def encoder_settings(self) -> dict:
        """PrecomputedEncoder's arguments for an index of these documents."""
        return {"d_cls": self.d_cls, "d_bow": self.d_bow, "bow_reduction": "sum" if self.maxsim_only else "mean",
                "learned_weight": 0.0 if self.maxsim_only else 0.3}

    @property
    def first_stage(self) -> str:
        """The first stage a fitted index of these documents gets (the model's default)."""
        return "centroids" if self.maxsim_only else "ivf"

    def chunk(self, number: int) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """Documents number*CHUNK .. +CHUNK-1: (ids, cls [n, d] fp16, bow [sum(counts), d] fp16, counts [n] int32)."""
        rng = np.random.default_rng([self.seed, number])
        counts = rng.choice(self.centres["count"], CHUNK).astype(np.int64)
        cls, bow, _ = draw(rng, self.centres, counts, 1.5, 0.5, 0.5)
        if self.maxsim_only:
            cls = mean_vectors(bow, counts)
        ids = [f"d{i:07d}" for i in range(number * CHUNK, (number + 1) * CHUNK)]
        return ids, cls, bow, counts.astype(np.int32)

    def documents(self, start: int, stop: int, batch: int):
        """(ids, cls, bow, counts) of documents start .. stop-1, in batches of at most `batch`."""
        at = start
        while at < stop:
            number = at // CHUNK
            ids, cls, bow, counts = self.chunk(number)
            first, last = at - number * CHUNK, min(CHUNK, stop - number * CHUNK)
            offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
            for a in range(first, last, batch):
                b = min(last, a + batch)
                yield ids[a:b], cls[a:b], bow[offsets[a]:offsets[b]], counts[a:b]
            at = number * CHUNK + last

    def queries(self, n: int, seed: int = 1):
        """QueryEmbeddings of n queries drawn around the same real vectors (tighter jitter)."""
        from espn.encoders import QueryEmbeddings

        rng = np.random.default_rng([self.seed, 10**6 + seed])
        counts = np.full(n, 32, np.int64) if self.maxsim_only else rng.integers(8, 25, n)
        cls, bow, _ = draw(rng, self.centres, counts, 1.2, 0.4, 0.5)
        if self.maxsim_only:
            cls = mean_vectors(bow, counts)
        width = int(counts.max())
        padded = np.zeros((n, width, self.d_bow), np.float32)
        mask = np.arange(width)[None, :] < counts[:, None]
        padded[mask] = bow.astype(np.float32)
        return QueryEmbeddings(cls.astype(np.float32), padded, mask)
