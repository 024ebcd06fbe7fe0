"""FAISS IVF over CLS vectors: train, add, save, load (mmap), and search split over clusters.

The pipeline visits the η probed clusters in segments (first δ, then the rest) so
a prefetch thread can start reading candidates before the ANN search ends.
`search_preassigned` takes its `nprobe` from a per-call `SearchParametersIVF`
instead of the shared `index.nprobe`, so concurrent searches never race.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import faiss
import numpy as np

__all__ = [
    "IVFConfig",
    "default_nlist",
    "build_ivf",
    "one_list_ivf",
    "load_ivf",
    "coarse_assign",
    "search_preassigned",
    "merge_topk",
    "segment_bounds",
    "list_sizes",
    "bitmap_selector",
]


@dataclasses.dataclass(frozen=True)
class IVFConfig:
    """kind: "flat" (IVF-Flat, exact distances) or "pq" (IVF-PQ, pq_m bytes per vector)."""

    nlist: int
    kind: str = "flat"
    pq_m: int = 32
    train_points_per_list: int = 100
    seed: int = 1234

    def factory_string(self) -> str:
        if self.kind == "flat":
            return f"IVF{self.nlist},Flat"
        if self.kind == "pq":
            return f"IVF{self.nlist},PQ{self.pq_m}"
        raise ValueError(f"ann kind must be 'flat' or 'pq', got {self.kind!r}")


def default_nlist(num_documents: int) -> int:
    """A power of two near 4·√N, with at least 39 training points per list (FAISS's floor)."""
    if num_documents < 39:
        return 1
    target = min(4 * math.sqrt(num_documents), num_documents / 39)
    return max(1, 2 ** int(math.floor(math.log2(target))))


def build_ivf(config: IVFConfig, d: int, train_vectors: np.ndarray) -> faiss.Index:
    """An empty trained IVF index over inner product (CLS vectors are compared by dot product)."""
    index = faiss.index_factory(d, config.factory_string(), faiss.METRIC_INNER_PRODUCT)
    ivf = faiss.extract_index_ivf(index)
    ivf.cp.seed = config.seed
    ivf.cp.max_points_per_centroid = config.train_points_per_list
    if config.kind == "pq":
        # The factory turns on polysemous training, which only serves Hamming-filtered
        # search (never used here) and dominates build time (70 s for 20k vectors).
        faiss.downcast_index(ivf).do_polysemous_training = False  # type: ignore[attr-defined]
    index.train(np.ascontiguousarray(train_vectors, dtype=np.float32))
    return index


def one_list_ivf(d: int) -> faiss.Index:
    """An IVF-Flat of one list whose centroid is the origin: nothing to train, and a search of its
    one list scans every vector (the first stage of an index too small to fit one)."""
    index = faiss.index_factory(d, "IVF1,Flat", faiss.METRIC_INNER_PRODUCT)
    ivf = faiss.extract_index_ivf(index)
    ivf.quantizer.add(np.zeros((1, d), dtype=np.float32))
    ivf.is_trained = True
    index.is_trained = True
    return index


def load_ivf(path: Path, mmap: bool = True) -> faiss.IndexIVF:
    """Open ann.faiss; IO_FLAG_MMAP maps the inverted lists so worker processes share one copy."""
    flags = faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY if mmap else 0
    index = faiss.read_index(str(path), flags)
    ivf = faiss.extract_index_ivf(index)
    ivf.referenced_objects = [index]  # type: ignore[attr-defined]  # the extracted view does not own `index`; keep it alive
    # search_preassigned runs serially under the default parallel_mode 0; mode 3 splits a
    # batch's queries over the OpenMP threads (one query is unchanged). Set once, here: the
    # attribute is shared, so it must never change per call.
    ivf.parallel_mode = 3
    return ivf


def list_sizes(index: faiss.IndexIVF) -> np.ndarray:
    """[nlist] int64 codes per inverted list (what a probe of each list costs to scan)."""
    invlists = index.invlists
    assert invlists is not None, "an IVF index always has inverted lists"
    return np.array([invlists.list_size(i) for i in range(index.nlist)], dtype=np.int64)


def coarse_assign(index: faiss.IndexIVF, xq: np.ndarray, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
    """The η nearest clusters per query: (centroid scores [n, η] float32, list ids [n, η] int64)."""
    return index.quantizer.search(np.ascontiguousarray(xq, dtype=np.float32), nprobe)


def bitmap_selector(allowed: np.ndarray) -> faiss.IDSelector:
    """A FAISS selector admitting the doc numbers where `allowed` [N] bool is True.

    The bits are packed once per call (N/8 bytes); FAISS tests each scanned code against
    them inside the search, so excluded documents never take a place in the top k.
    """
    bits = np.packbits(np.ascontiguousarray(allowed, dtype=bool), bitorder="little")
    selector = faiss.IDSelectorBitmap(len(bits), faiss.swig_ptr(bits))
    selector.referenced_objects = [bits]  # type: ignore[attr-defined]  # FAISS keeps a raw pointer
    return selector


def search_preassigned(
    index: faiss.IndexIVF, xq: np.ndarray, k: int, list_ids: np.ndarray, coarse_scores: np.ndarray,
    selector: faiss.IDSelector | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Search only `list_ids` [n, m] per query; returns (scores [n, k], doc numbers [n, k], -1 = none).

    Thread-safe: the probe count comes from per-call parameters, not `index.nprobe`.
    selector (e.g. `bitmap_selector`) restricts the search to the documents it admits.
    """
    xq = np.ascontiguousarray(xq, dtype=np.float32)
    list_ids = np.ascontiguousarray(list_ids, dtype=np.int64)
    coarse_scores = np.ascontiguousarray(coarse_scores, dtype=np.float32)
    n, m = list_ids.shape
    scores = np.empty((n, k), dtype=np.float32)
    labels = np.empty((n, k), dtype=np.int64)
    if m == 0:
        scores.fill(-np.inf)
        labels.fill(-1)
        return scores, labels
    params = faiss.SearchParametersIVF(nprobe=m)  # type: ignore[call-arg]  # SWIG kwargs; stubs lag
    if selector is not None:
        params.sel = selector
    index.search_preassigned_c(  # type: ignore[attr-defined]
        n,
        faiss.swig_ptr(xq),
        k,
        faiss.swig_ptr(list_ids),
        faiss.swig_ptr(coarse_scores),
        faiss.swig_ptr(scores),
        faiss.swig_ptr(labels),
        False,
        params,
    )
    # FAISS marks empty slots with -1 labels; give them -inf so merges never pick them.
    scores[labels < 0] = -np.inf
    return scores, labels


def merge_topk(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Merge two per-query top lists over disjoint clusters (a doc is in one cluster only)."""
    scores = np.concatenate([a[0], b[0]], axis=1)
    labels = np.concatenate([a[1], b[1]], axis=1)
    # Stable sort on -score keeps FAISS's tie order (earlier segment first).
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, 1), np.take_along_axis(labels, order, 1)


def segment_bounds(nprobe: int, step: float) -> list[tuple[int, int]]:
    """Cluster ranges [a, b) of the probe list: δ = ceil(step·η) clusters each, last one shorter."""
    delta = max(1, math.ceil(step * nprobe))
    return [(a, min(a + delta, nprobe)) for a in range(0, nprobe, delta)]
