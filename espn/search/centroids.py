"""The centroid first stage at query time (the index format and its build: `espn.first_stage`).

For models without a trained CLS vector: each query token's nearest centroids give
candidates (`TokenCentroids.candidates`), every candidate is read and scored with exact
MaxSim; "union" adds the IVF's top `rerank_count`. A live generation searches the base's
centroid index plus the postings of each delta segment, computed once per segment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..ann import bitmap_selector, coarse_assign, search_preassigned
from ..encoders import QueryEmbeddings
from ..errors import InvalidParameterError
from ..first_stage import FirstStageConfig, Postings, TokenCentroids, assign_documents, postings_from_pairs
from ..maxsim import QueryScoring
from ..params import SearchParams
from ..results import QueryResult, SearchStats
from ..segments import LiveView, RecordTable
from ..store import Reader
from .context import SearchContext, Timer
from .filtered import FilteredDocs
from .scoring import ExtraDocs, Scored, rank_hits, score_pairs, share

__all__ = ["open_centroids", "search_centroids"]

#: shared(key, make, close): one object per live-index base (`GenerationResources.shared`)
Share = Callable[[str, Callable[[], Any], Callable[[Any], None]], Any]


def open_centroids(shared: Share, index_path: Path, view: LiveView | None, records: np.ndarray | RecordTable,
                   reader: Reader) -> TokenCentroids:
    """The base's centroid index (shared by every generation over the base) plus the postings
    of each delta segment, computed once per segment from its records (segments never change)."""
    base: TokenCentroids = shared("first-stage", lambda: TokenCentroids.open(index_path), lambda _: None)
    if view is None or not view.segments:
        return base
    extra: list[Postings] = []
    for name, segment in view.segments.items():
        first, stop = segment.info.first, segment.info.stop

        def make(first: int = first, stop: int = stop) -> Postings:
            return segment_postings(base, records, reader, first, stop)

        extra.append(view.shared.attached(f"first-stage:{name}", make, lambda _: None))
    return base.with_parts(extra)


def segment_postings(base: TokenCentroids, records: np.ndarray | RecordTable, reader: Reader, first: int,
                     stop: int, block: int = 4096) -> Postings:
    """centroid -> doc CSR of a delta's documents (first .. stop-1) against the base's centroids."""
    numbers = np.arange(first, stop, dtype=np.int64)
    numbers = numbers[records[numbers]["n_bow"] > 0]  # holes of merged deltas hold nothing
    pairs = [assign_documents(base.centroids, batch.vectors.float().cpu().numpy(), batch.offsets, part)
             for part in np.array_split(numbers, max(1, -(-len(numbers) // block)))
             for batch in [reader.read(part)] if len(part)]
    if not pairs:
        return postings_from_pairs(np.zeros(0, np.int64), np.zeros(0, np.int64), len(base.centroids))
    return postings_from_pairs(np.concatenate([c for c, _ in pairs]), np.concatenate([d for _, d in pairs]),
                               len(base.centroids))


def search_centroids(context: SearchContext, q: QueryEmbeddings, params: SearchParams, stage: FirstStageConfig,
                     timer: Timer, allowed: np.ndarray | None, filtered: FilteredDocs | None,
                     extra: ExtraDocs | None,
                     pools: list[Scored] | None) -> list[QueryResult]:
    """The centroid first stage, then exact MaxSim of every candidate read from the records.
    Same contract as `espn.search.dense.search_dense`."""
    if context.centroids is None:
        raise InvalidParameterError(f"first_stage {stage.kind!r} needs a centroid index, and this index has "
                                    f"none (build it with `espn index --first-stage centroids`)")
    batch = len(q)
    xq = np.ascontiguousarray(q.cls, dtype=np.float32)
    queries = QueryScoring.from_arrays(xq, q.bow, q.mask)
    per_query = centroid_candidates(context, q, xq, params, stage, _candidate_mask(context, allowed, filtered), timer)
    if extra is not None:  # hybrid's lexical documents: scored with the rest (read again: one read)
        extra_docs, extra_records = extra.result()
        if extra_records is not None:
            extra_records.release()
        per_query = [np.union1d(docs, np.asarray(more, dtype=np.int64))
                     for docs, more in zip(per_query, list(extra_docs) + [np.zeros(0, np.int64)] * batch)]
    scores, bytes_read, ios = _score_candidates(context, queries, per_query, timer)
    timer.lap("maxsim")
    bounds = np.cumsum([0] + [len(d) for d in per_query])
    out = []
    for i, found in enumerate(per_query):
        cls_scores, bow_scores = scores[0, bounds[i]:bounds[i + 1]], scores[1, bounds[i]:bounds[i + 1]]
        out.append(rank_hits(context, np.zeros(len(found), np.float32), found, found, cls_scores, bow_scores,
                             params.k))
        if pools is not None:
            pools.append((np.asarray(found, dtype=np.int64), cls_scores, bow_scores))
    timer.lap("aggregate")
    stage_ms = timer.total()
    # No prefetcher runs beside this stage (every candidate is read after it): hit rate 0.
    return [QueryResult(hits=hits, stats=SearchStats(
        stage_ms=stage_ms, hit_rate=0.0, bytes_read=share(bytes_read, i, batch), ios=share(ios, i, batch),
        prefetched=0, missed=len(per_query[i]), engine=context.reader.engine,
        matched=None if filtered is None else filtered.matches,
        filter_path=None if filtered is None else "all" if filtered.matches >= context.live_count else "centroids"))
        for i, hits in enumerate(out)]


def _candidate_mask(context: SearchContext, allowed: np.ndarray | None,
                    filtered: FilteredDocs | None) -> np.ndarray | None:
    """[N] bool: live, allowed and matching the filter (None: every document)."""
    mask = context.live
    if allowed is not None:
        mask = allowed if mask is None else allowed & mask
    if filtered is not None and filtered.matches < context.live_count:
        mask = filtered.mask if mask is None else filtered.mask & mask
    return mask


def centroid_candidates(context: SearchContext, q: QueryEmbeddings, xq: np.ndarray, params: SearchParams,
                        stage: FirstStageConfig, mask: np.ndarray | None, timer: Timer) -> list[np.ndarray]:
    """Per query, the doc numbers to score: the centroid estimate's top, and for "union" the IVF's."""
    assert context.centroids is not None
    depth = max(stage.candidates, params.k)
    per_query = context.centroids.candidates(np.asarray(q.bow, dtype=np.float32), np.asarray(q.mask, dtype=bool),
                                             stage.probe, depth, mask)
    timer.lap("first_stage")
    if stage.kind == "union" and params.rerank_count > 0:
        selector = None if mask is None else (context.live_selector if mask is context.live
                                              else bitmap_selector(mask))
        coarse_scores, lists = coarse_assign(context.ann, xq, params.nprobe)
        _, labels = search_preassigned(context.ann, xq, params.rerank_count, lists, coarse_scores, selector)
        per_query = [np.union1d(docs, found[found >= 0]) for docs, found in zip(per_query, labels)]
        timer.lap("ann")
    return per_query


def _score_candidates(context: SearchContext, queries: QueryScoring, per_query: list[np.ndarray],
                      timer: Timer) -> tuple[np.ndarray, int, int]:
    """[2, P] exact CLS and MaxSim of every (query, candidate) pair in order; bytes read, ios."""
    n_docs = context.num_documents
    keys = np.concatenate([i * n_docs + np.asarray(docs, dtype=np.int64) for i, docs in enumerate(per_query)])
    docs = np.unique(keys % n_docs)
    scores = np.zeros((2, len(keys)), dtype=np.float32)
    bytes_read = ios = 0
    if len(keys):
        with context.reader.submit(docs).records() as records:
            timer.lap("miss_read")
            bytes_read, ios = records.bytes_read, records.ios
            scores = score_pairs(context, queries, records, keys, n_docs)
    return scores, bytes_read, ios
