"""Merging the partitions' answers into one: top-k by score, or a hybrid pool fused as one
index fuses its own (see the package doc for what is exact and what is not)."""

from __future__ import annotations

import heapq
from typing import Any, Sequence

import numpy as np

from espn.engine import PARTITIONS

from ..schemas import MAX_EXPLAIN_K, MAX_HTTP_K, SearchHit, SearchOptions, SearchResponse
from .models import RoutedSearchResponse, RoutedStats, ShardFailure

__all__ = ["merge_hits", "fuse_hits", "fan_out_body", "merge_responses"]


def merge_hits(per_shard: Sequence[Sequence[SearchHit]], k: int) -> list[SearchHit]:
    """Top-k of the union by score, descending; ties keep shard order, then rank order.

    Each input list is one partition's ranking (descending). Partitions hold disjoint
    documents, so no de-duplication is needed; if the same id came twice (a document
    indexed in two partitions by mistake) only its first, highest-scored copy is kept.
    """
    merged: list[SearchHit] = []
    seen: set[str] = set()
    streams = [[(-hit.score, shard, rank, hit) for rank, hit in enumerate(hits)] for shard, hits in enumerate(per_shard)]
    for _, _, _, hit in heapq.merge(*streams, key=lambda item: item[:3]):
        if hit.id in seen:
            continue
        seen.add(hit.id)
        merged.append(hit)
        if len(merged) == k:
            break
    return merged


def _top(scores: np.ndarray, n: int) -> np.ndarray:
    """Rows of the n highest scores (NaN: not on that side's list), best first."""
    present = np.flatnonzero(~np.isnan(scores))
    return present[np.argsort(-scores[present], kind="stable")[:n]]


def fuse_hits(per_shard: Sequence[Sequence[SearchHit]], k: int, hybrid: dict[str, Any]) -> list[SearchHit]:
    """The partitions' hybrid pools fused as one index fuses its own (see the package doc).

    per_shard: each partition's pool with `dense_score` and `lexical_score`; hybrid: the
    parameters the partitions report (`stats.hybrid`).
    """
    seen: dict[str, SearchHit] = {}
    for hits in per_shard:
        for hit in hits:
            seen.setdefault(hit.id, hit)
    hits = list(seen.values())
    nan = float("nan")
    dense = np.array([nan if h.dense_score is None else h.dense_score for h in hits], dtype=np.float32)
    lexical = np.array([nan if h.lexical_score is None else h.lexical_score for h in hits], dtype=np.float32)
    params = PARTITIONS.hybrid_params(hybrid)
    rerank_count = PARTITIONS.rerank_count(hybrid)  # every shard reports its own
    in_lexical = _top(lexical, params.lexical_k)
    pool = np.union1d(_top(dense, rerank_count), in_lexical)
    lexical_pool = np.full(len(hits), np.nan, dtype=np.float32)
    lexical_pool[in_lexical] = lexical[in_lexical]  # below the global lexical top: not on that list
    fused = PARTITIONS.fuse(pool, dense[pool], lexical_pool[pool], params)
    out = []
    for row, score, lexical_score in zip(fused.doc[:k].tolist(), fused.score[:k].tolist(), fused.lexical[:k].tolist()):
        out.append(hits[row].model_copy(update={
            "score": score, "lexical_score": None if lexical_score != lexical_score else lexical_score}))
    return out


def fan_out_body(body: SearchOptions) -> dict[str, Any]:
    """What the partitions are asked: a hybrid search asks each for its whole pool."""
    out = body.model_dump(exclude_none=True)
    if body.mode == "hybrid":
        out["k"] = MAX_EXPLAIN_K if out.get("explain") else MAX_HTTP_K
    return out


def _combine_stats(answered: Sequence[SearchResponse], total: int, route_ms: float) -> RoutedStats:
    stats = [response.stats for response in answered]
    stage_ms: dict[str, float] = {}
    for item in stats:
        for stage, ms in item.stage_ms.items():
            stage_ms[stage] = max(stage_ms.get(stage, 0.0), ms)
    return RoutedStats(
        stage_ms=stage_ms,
        queue_ms=max((s.queue_ms for s in stats), default=0.0),
        batch_size=max((s.batch_size for s in stats), default=0),
        hit_rate=sum(s.hit_rate for s in stats) / len(stats) if stats else 0.0,
        bytes_read=sum(s.bytes_read for s in stats),
        ios=sum(s.ios for s in stats),
        prefetched=sum(s.prefetched for s in stats),
        missed=sum(s.missed for s in stats),
        shards_answered=len(stats),
        shards_total=total,
        route_ms=round(route_ms, 3),
        syntax=next((s.syntax for s in stats if s.syntax), None),
        ignored=next((s.ignored for s in stats if s.ignored), None),
    )


def merge_responses(query: str, answered: Sequence[SearchResponse], k: int, total: int,
                    failures: list[ShardFailure], route_ms: float) -> RoutedSearchResponse:
    """One query's answers from the partitions that gave one, as one answer."""
    pools = [response.results for response in answered]
    hybrid = next((r.stats.hybrid for r in answered if r.stats.mode == "hybrid" and r.stats.hybrid), None)
    return RoutedSearchResponse(
        query=query,
        results=merge_hits(pools, k) if hybrid is None else fuse_hits(pools, k, hybrid),
        stats=_combine_stats(answered, total, route_ms),
        partial=bool(failures),
        failed_shards=failures,
    )
