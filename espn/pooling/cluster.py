"""Token pooling at index time: fewer BOW vectors per document, most of the MaxSim signal kept.

Each document's BOW vectors are clustered hierarchically (Ward linkage, as PyLate's token
pooling does) into `max(1, n // factor)` clusters and each cluster is replaced by the mean
of its members. Neighbouring tokens of one word or phrase tend to sit close together, so a
query vector's best match moves little. Deterministic: the same vectors always give the
same clusters, and pooled rows follow the order of each cluster's first source token, so
`groups` maps every stored vector back to the token vectors (and so the text) it merged.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidParameterError

__all__ = ["pool_vectors", "pool_documents", "pool_documents_grouped"]


def pool_vectors(vectors: np.ndarray, factor: int) -> tuple[np.ndarray, np.ndarray]:
    """Pool one document's vectors: vectors [n, d] -> (pooled [m, d] float32, groups [n] int64).

    m = max(1, n // factor) (fewer when vectors coincide); groups[i] is the pooled row that
    source vector i went into, so pooled[j] = vectors[groups == j].mean(0). factor 1 (or
    n <= 1) returns the vectors unchanged with groups = arange(n).

    >>> v = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    >>> pooled, groups = pool_vectors(v, 2)
    >>> groups.tolist(), pooled.astype(np.float64).round(2).tolist()
    ([0, 0, 1, 1], [[0.95, 0.05], [0.05, 0.95]])
    """
    if not isinstance(factor, (int, np.integer)) or factor < 1:
        raise InvalidParameterError(f"pool factor must be an integer >= 1, got {factor!r}")
    x = np.asarray(vectors, dtype=np.float32)
    n = len(x)
    clusters = max(1, n // int(factor))
    if factor == 1 or n <= 1 or clusters >= n:
        return x.copy(), np.arange(n, dtype=np.int64)
    from scipy.cluster.hierarchy import fcluster, linkage

    labels = fcluster(linkage(x.astype(np.float64), method="ward"), t=clusters, criterion="maxclust")
    # Renumber clusters by their first member, so pooled rows follow the text.
    _, first = np.unique(labels, return_index=True)
    rank = np.empty(int(labels.max()) + 1, dtype=np.int64)
    rank[labels[np.sort(first)]] = np.arange(len(first))
    groups = rank[labels]
    # Cluster sums by one sort and a segmented sum (np.add.at is ~10x slower here).
    order = np.argsort(groups, kind="stable")
    sizes = np.bincount(groups)
    sums = np.add.reduceat(x[order].astype(np.float64), np.cumsum(sizes) - sizes, axis=0)
    pooled = (sums / sizes[:, None]).astype(np.float32)
    return pooled, groups


def pool_documents(bow: np.ndarray, counts: np.ndarray, factor: int) -> tuple[np.ndarray, np.ndarray]:
    """Pool a chunk of documents: bow [sum(counts), d], counts [n] -> (pooled bow, pooled counts [n] int64).

    One clustering per document (a loop over the chunk's documents at index time; Ward on
    ~250 vectors takes well under a millisecond).
    """
    if factor == 1:
        return np.asarray(bow), np.asarray(counts, dtype=np.int64)
    pooled, new_counts, _ = pool_documents_grouped(bow, counts, factor)
    return pooled, new_counts


def pool_documents_grouped(bow: np.ndarray, counts: np.ndarray, factor: int
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`pool_documents` plus the groups: (pooled bow, pooled counts [n], groups [sum(counts)] int64),
    where groups holds each document's `pool_vectors` groups in turn (what
    `espn.pooling.groups` stores so that explain need not pool again)."""
    counts = np.asarray(counts, dtype=np.int64)
    bow = np.asarray(bow)
    ends = np.cumsum(counts)
    results = [pool_vectors(bow[end - count: end], factor) for end, count in zip(ends.tolist(), counts.tolist())]
    new_counts = np.array([len(pooled) for pooled, _ in results], dtype=np.int64)
    width = bow.shape[1] if bow.ndim == 2 else 0
    pooled = np.concatenate([p for p, _ in results]) if results else np.zeros((0, width), np.float32)
    groups = np.concatenate([g for _, g in results]) if results else np.zeros(0, np.int64)
    return pooled.reshape(-1, width), new_counts, groups.astype(np.int64, copy=False)
