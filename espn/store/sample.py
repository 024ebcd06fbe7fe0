"""A random sample of stored token vectors, whole documents at a time: what the first stage's
token centroids (`espn.first_stage.centroids`) and the residual codec (`espn.store.recode`)
train on, so that both see the same draw."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["sample_vectors", "sample_records"]


def sample_vectors(vectors_of: Any, n_docs: int, n_tokens: int, wanted: int, seed: int = 1234,
                   block: int = 4096) -> np.ndarray:
    """Stored vectors [~wanted, d] float32 of whole documents drawn at random, read block by
    block through `vectors_of(doc_numbers) -> (vectors [T, d], offsets [n+1])`."""
    per_doc = max(1.0, n_tokens / max(1, n_docs))
    rng = np.random.default_rng(seed)
    docs = np.sort(rng.choice(n_docs, size=min(n_docs, int(wanted / per_doc) + 1), replace=False))
    return np.concatenate([np.asarray(vectors_of(docs[a:a + block])[0], dtype=np.float32)
                           for a in range(0, len(docs), block)])


def sample_records(reader: Any, records: np.ndarray, wanted: int, seed: int = 1234, block: int = 4096) -> np.ndarray:
    """`sample_vectors` of the records `reader` reads (records: their table, for the counts)."""
    def vectors_of(numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        batch = reader.read(numbers)
        return batch.vectors.float().numpy(), batch.offsets

    return sample_vectors(vectors_of, len(records), int(records["n_bow"].sum()), wanted, seed, block)
