"""`espn calibrate`: fit the score weight w (or, with --hybrid, the fusion and its mix weight)
on training queries, and store it in the index's manifest."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import numpy as np

from .. import Searcher
from ..corpus import read_qrels, read_queries
from ..errors import InvalidParameterError
from ..evaluation import evaluate, strictly_decreasing
from ..search.hybrid import fuse
from ..index import update_manifest
from ..params import MAX_K
from .common import reader_options

__all__ = ["cmd_calibrate"]

log = logging.getLogger("espn")


def cmd_calibrate(args: argparse.Namespace) -> int:
    options = reader_options(args)
    queries, qrels = read_queries(args.queries), read_qrels(args.qrels)
    searcher = Searcher.open(args.index, reader=args.reader, reader_options=options,
                             trust_remote_code=args.trust_remote_code)
    queries = [(qid, text) for qid, text in queries if qid in qrels]
    if not queries:
        raise InvalidParameterError(f"--qrels {args.qrels}: no query of --queries has judgements in it")
    if args.hybrid:
        return _calibrate_hybrid(searcher, queries, qrels, args)
    params = searcher.defaults
    heads: dict[str, list] = {}
    for start in range(0, len(queries), 32):
        batch = queries[start : start + 32]
        results = searcher.search([t for _, t in batch], k=params.rerank_count)
        for (qid, _), result in zip(batch, results):
            heads[qid] = [(h.doc_id, h.cls_score, h.bow_score) for h in result.hits if h.bow_score is not None]
    best_w, best = None, -1.0
    for w in np.round(np.arange(0.0, 1.0001, 0.05), 2):
        run = {qid: {d: float(w * c + (1 - w) * b) for d, c, b in hits} for qid, hits in heads.items()}
        value = evaluate(run, qrels)[args.measure]
        log.debug("w=%.2f %s=%.4f", w, args.measure, value)
        if value > best + 1e-9:
            best_w, best = float(w), value
    print(f"best w = {best_w:.2f} ({args.measure} {best:.4f} on {len(heads)} queries; was {searcher.weight:.2f})")
    if not args.dry_run:
        # The manifest of the base the searcher serves: after a live index's compaction that is
        # live/base-N, whose manifest the next compaction carries forward.
        update_manifest(searcher.index.path, score={**searcher.manifest["score"], "w": best_w, "calibrated": True,
                                           "calibrated_on": str(Path(args.qrels).absolute())})
    return 0


def _calibrate_hybrid(searcher: Any, queries: list[tuple[str, str]], qrels: Any, args: argparse.Namespace) -> int:
    """Fit the mix weight: one hybrid search per query returns its whole fusion pool with both
    sides' scores, then every weight on a 0.05 grid is fused from those (`espn.search.hybrid.fuse`)."""
    hybrid = searcher.hybrid_params(mode="hybrid", fusion="mix")
    depth = min(MAX_K, searcher.defaults.rerank_count + hybrid.lexical_k)
    pools: dict[str, tuple[list[str], np.ndarray, np.ndarray]] = {}
    for start in range(0, len(queries), 32):
        batch = queries[start : start + 32]
        for (qid, _), result in zip(batch, searcher.search([t for _, t in batch], k=depth, mode="hybrid", fusion="mix")):
            nan = float("nan")
            pools[qid] = ([h.doc_id for h in result.hits],
                          np.array([nan if h.dense_score is None else h.dense_score for h in result.hits], np.float32),
                          np.array([nan if h.lexical_score is None else h.lexical_score for h in result.hits], np.float32))
    def measure(params: Any) -> float:
        run = {}
        for qid, (docs, dense, lexical) in pools.items():
            fused = fuse(np.array(docs, dtype=object), dense, lexical, params)
            run[qid] = dict(strictly_decreasing([(str(d), float(v)) for d, v in zip(fused.doc, fused.score)]))
        return evaluate(run, qrels)[args.measure]

    best_fusion, best_weight, best = "mix", hybrid.mix_weight, -1.0
    for fusion in ("mix", "zscore"):  # both weighted fusions, each over the grid
        for weight in np.round(np.arange(0.0, 1.0001, 0.05), 2):
            value = measure(hybrid.replace(fusion=fusion, mix_weight=float(weight)))
            log.debug("%s mix_weight=%.2f %s=%.4f", fusion, weight, args.measure, value)
            if value > best + 1e-9:
                best_fusion, best_weight, best = fusion, float(weight), value
    rrf = measure(hybrid.replace(fusion="rrf"))
    fusion = best_fusion if best >= rrf else "rrf"
    print(f"best mix_weight = {best_weight:.2f} with {best_fusion} ({args.measure} {best:.4f} on {len(pools)} "
          f"queries; was {hybrid.mix_weight:.2f}); rrf {rrf:.4f}; default fusion: {fusion}")
    if not args.dry_run:
        update_manifest(searcher.index.path, hybrid={**hybrid.to_json(), "fusion": fusion, "mix_weight": best_weight,
                                                     "calibrated_on": str(Path(args.qrels).absolute())})
    return 0
