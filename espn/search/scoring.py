"""Scoring shared by every search path: exact pair scores from read records, and the final
ranking `w · cls + (1 − w) · bow` over a re-ranked head followed by the rest in CLS order."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Sequence

import numpy as np

from ..maxsim import QueryScoring, score_records
from ..results import Hit
from ..store import RecordBatch
from .context import SearchContext

__all__ = ["Scored", "ExtraDocs", "score_pairs", "rank_hits", "share"]

#: One query's scored candidates: doc numbers [m] int64, exact CLS [m] and BOW [m] float32.
Scored = tuple[np.ndarray, np.ndarray, np.ndarray]
#: Hybrid's lexical side, running beside the dense scan: per query the doc numbers to score
#: besides the re-ranked head, and those documents read already (None: the search reads them).
ExtraDocs = Future[tuple[Sequence[np.ndarray], RecordBatch | None]]


def score_pairs(context: SearchContext, queries: QueryScoring, records: RecordBatch, keys: np.ndarray,
                n_docs: int) -> np.ndarray:
    """[2, P] float32: exact CLS and MaxSim of the (query, doc) `keys` (query · n_docs + doc),
    whose records `records` holds."""
    return score_records(queries, records, context.layout, keys // n_docs, records.rows_of(keys % n_docs),
                         context.bow_reduction)


def rank_hits(context: SearchContext, ann_scores: np.ndarray, ann_docs: np.ndarray, rerank: np.ndarray,
              head_cls: np.ndarray, head_bow: np.ndarray, k: int) -> list[Hit]:
    """Re-ranked head by `w·cls + (1−w)·bow`, then the rest in CLS order, k in all."""
    weight = context.weight
    valid = ann_docs >= 0
    ann_scores, ann_docs = ann_scores[valid], ann_docs[valid]
    head_n = len(rerank)
    combined = weight * head_cls + (1 - weight) * head_bow
    order = np.argsort(-combined, kind="stable")[:k]
    # Python floats in one call per column (tolist), not one numpy scalar per hit and column.
    hits = [
        Hit(doc_id, score, cls, bow)
        for doc_id, score, cls, bow in zip(context.ids.external(rerank[order]), combined[order].tolist(),
                                           head_cls[order].tolist(), head_bow[order].tolist())
    ]
    tail = slice(head_n, min(len(ann_docs), k))
    if tail.start < tail.stop:
        tail_cls = ann_scores[tail]
        # Below the re-ranked head, keep CLS order; scores stay under the head's and fall
        # strictly (a 1e-6 step per rank, so w = 0 or equal CLS scores cannot tie), so tools
        # that sort by score (trec_eval) see the same ranking.
        floor = float(combined.min()) if head_n else float(tail_cls[0])
        steps = np.arange(1 if head_n else 0, len(tail_cls) + (1 if head_n else 0), dtype=np.float64) * 1e-6
        tail_scores = floor - weight * (float(tail_cls[0]) - tail_cls) - steps
        hits += [
            Hit(doc_id, score, cls, None)
            for doc_id, score, cls in zip(context.ids.external(ann_docs[tail]), tail_scores.tolist(), tail_cls.tolist())
        ]
    return hits


def share(total: int, i: int, n: int) -> int:
    """Split a batch total over its queries so that per-query numbers add up to it."""
    return total // n + (1 if i < total % n else 0)
