"""IR evaluation through ir_measures (pytrec_eval underneath): one call, TREC vocabulary."""

from __future__ import annotations

from typing import Mapping, Sequence

import ir_measures
from ir_measures import R, RR, nDCG

__all__ = ["DEFAULT_MEASURES", "evaluate", "write_run", "strictly_decreasing"]

# Smallest step the run file shows (scores are written with 6 decimals).
SCORE_STEP = 1e-6

DEFAULT_MEASURES = (nDCG @ 10, RR @ 10, R @ 100, R @ 1000)

Run = Mapping[str, Mapping[str, float]]


def evaluate(run: Run, qrels: Mapping[str, Mapping[str, int]], measures=DEFAULT_MEASURES) -> dict[str, float]:
    """Mean of each measure over the judged queries; keys like 'nDCG@10'."""
    judged = {qid: docs for qid, docs in qrels.items() if qid in run}
    values = ir_measures.calc_aggregate(list(measures), judged, {qid: dict(d) for qid, d in run.items() if qid in judged})
    return {str(m): float(values[m]) for m in measures}


def strictly_decreasing(hits: Sequence[tuple[str, float]]) -> list[tuple[str, float]]:
    """The ranking with every tie broken downwards by SCORE_STEP, so the order survives sorting by score.

    trec_eval and ir_measures sort a run by score and break ties by document id: with
    w = 0 every hit below the re-ranked head scores 0 and would be reordered by id.
    Tied scores become score, score - 1e-6, ...; distinct scores are kept as written.
    """
    out: list[tuple[str, float]] = []
    previous = float("inf")
    for doc_id, score in hits:
        value = round(float(score), 6)
        if value >= previous:
            value = round(previous - SCORE_STEP, 6)
        out.append((doc_id, value))
        previous = value
    return out


def write_run(path, ranked: Mapping[str, list[tuple[str, float]]], tag: str = "espn") -> None:
    """TREC run file: `query_id Q0 doc_id rank score tag`, ranks from 1, scores strictly decreasing."""
    with open(path, "w", encoding="utf-8") as f:
        for query_id, hits in ranked.items():
            for rank, (doc_id, score) in enumerate(strictly_decreasing(hits), start=1):
                f.write(f"{query_id} Q0 {doc_id} {rank} {score:.6f} {tag}\n")
