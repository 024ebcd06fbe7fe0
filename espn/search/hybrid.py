"""Hybrid retrieval: the search modes, their parameters, and score fusion.

A hybrid search pools the dense side's re-ranked head and the lexical side's top
`lexical_k`. With `union` (the default) the documents only BM25 found are read and
MaxSim-scored too, in the same read and MaxSim call as the dense head, so every pooled
document has a late-interaction score. The pool is then fused:

- `rrf`: Σ 1 / (rrf_k + rank) over the two rankings (a side that lacks a document adds 0);
- `mix`: α · dense' + (1 − α) · lexical', each side min-max normalised over its own list
  (a document missing from the lexical list counts 0 there); α = `mix_weight`, fitted by
  `espn calibrate` on training queries and stored in the manifest (`hybrid.mix_weight`).
- `zscore`: the same mix of each side standardised over the pool (mean 0, sd 1; a document
  missing from the lexical list counts as its lowest).

`fuse` is the one definition of the fused ranking: the Searcher calls it per query, and
the router calls it on the pools of every partition so a partitioned index ranks as one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..choices import FUSIONS, MODES
from ..params import HybridParams

__all__ = ["MODES", "FUSIONS", "Fused", "fuse"]

@dataclasses.dataclass(frozen=True)
class Fused:
    """One query's fused ranking, best first: doc [n] (any integer keys), score [n] float64,
    dense [n] and lexical [n] float32 (NaN where that side has no score)."""

    doc: np.ndarray
    score: np.ndarray
    dense: np.ndarray
    lexical: np.ndarray


def _ranks(scores: np.ndarray) -> np.ndarray:
    """1-based rank by score, descending (NaN: unranked -> inf); ties keep input order."""
    present = ~np.isnan(scores)
    order = np.argsort(np.where(present, -scores, np.inf), kind="stable")
    ranks = np.empty(len(scores), dtype=np.float64)
    ranks[order] = np.arange(1, len(scores) + 1, dtype=np.float64)
    ranks[~present] = np.inf
    return ranks


def _min_max(scores: np.ndarray) -> np.ndarray:
    """Scaled to [0, 1] over the present scores (all equal: 1); missing: 0."""
    present = ~np.isnan(scores)
    out = np.zeros(len(scores), dtype=np.float64)
    if present.any():
        low, high = float(np.min(scores[present])), float(np.max(scores[present]))
        out[present] = 1.0 if high <= low else (scores[present].astype(np.float64) - low) / (high - low)
    return out


def _z_score(scores: np.ndarray) -> np.ndarray:
    """Standardised over the present scores (mean 0, sd 1; all equal: 0); missing: the lowest present."""
    present = ~np.isnan(scores)
    out = np.zeros(len(scores), dtype=np.float64)
    if present.any():
        values = scores[present].astype(np.float64)
        sd = float(values.std())
        out[present] = (values - values.mean()) / sd if sd > 0 else 0.0
        out[~present] = float(out[present].min())
    return out


def fuse(doc: np.ndarray, dense: np.ndarray, lexical: np.ndarray, params: HybridParams) -> Fused:
    """Fuse one query's pool: doc [m] distinct keys, dense [m] and lexical [m] scores (NaN:
    not on that side's list). Ties break on the dense score, then the lexical score, then
    the input order."""
    dense = np.asarray(dense, dtype=np.float32)
    lexical = np.asarray(lexical, dtype=np.float32)
    if params.fusion == "rrf":
        score = 1.0 / (params.rrf_k + _ranks(dense)) + 1.0 / (params.rrf_k + _ranks(lexical))
    elif params.fusion == "zscore":
        score = params.mix_weight * _z_score(dense) + (1.0 - params.mix_weight) * _z_score(lexical)
    else:
        score = params.mix_weight * _min_max(dense) + (1.0 - params.mix_weight) * _min_max(lexical)
    order = np.lexsort((np.arange(len(doc)), -np.nan_to_num(lexical, nan=-np.inf),
                        -np.nan_to_num(dense, nan=-np.inf), -score))
    return Fused(np.asarray(doc)[order], score[order], dense[order], lexical[order])
