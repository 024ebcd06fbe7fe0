"""Lexical and hybrid searches over a SearchContext (dense searches: `espn.search.dense`).

Hybrid, per batch: the lexical search starts on a worker thread before the queries are
encoded (the engine releases the GIL), so it costs the critical path only what is left of
it after encoding. With `union`, what only BM25 found goes into `search_dense` as
extra documents: their reads start with the ANN scan and they share its MaxSim call. The
pool of each query (re-ranked head + lexical top `lexical_k`) is then fused by
`espn.search.hybrid.fuse`. Filters and the live index's deletions restrict both sides through one
bitmap; required (+) and excluded (-) clauses hold for every hit, on both sides.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..encoders import QueryEmbeddings
from ..params import SearchParams
from ..results import Hit, QueryResult, SearchStats
from ..store import RecordBatch
from ..text.query import LexicalQuery, parse_query
from .context import SearchContext, Timer
from .dense import search_dense
from .explain import explain_results
from .long_queries import mark_truncated
from .filtered import FilteredDocs
from ..params import HybridParams
from .hybrid import fuse
from .lexical import lexical_matches, require_text, search_batch
from .scoring import ExtraDocs, Scored

if TYPE_CHECKING:
    from ..text.engine import LexicalHits, TextIndex

__all__ = ["search_modes"]


def search_modes(context: SearchContext, texts: Sequence[str], params: SearchParams, hybrid: HybridParams,
                 filtered: FilteredDocs | None, explain: bool, timer: Timer,
                 embeddings: QueryEmbeddings | None = None) -> list[QueryResult]:
    """A lexical or hybrid search of `texts`, read in `hybrid.syntax` (`espn.text.query`).

    embeddings: the queries encoded elsewhere (`search_embeddings`); None encodes the
    queries' dense text (as typed in plain syntax; without the simple syntax's operators,
    quotes and excluded clauses).
    """
    text = require_text(context.text, hybrid.mode)
    parsed = [parse_query(query, hybrid.syntax) for query in texts]
    allowed = filtered.mask if filtered is not None else context.live
    if hybrid.mode == "lexical":
        lexical = search_batch(text, parsed, params.k, allowed)
        timer.lap("lexical")
        results = [_lexical_result(context, hits, filtered) for hits in lexical]
    else:
        found: list[LexicalHits] = []

        def lexical_side() -> tuple[Sequence[np.ndarray], RecordBatch | None]:
            # On a worker while the queries are encoded and the ANN scans: BM25, then (union)
            # the reads of its documents (submitted and reaped on this thread, as ring-based
            # engines require), so the dense pipeline finds them read and only scores them.
            found.extend(search_batch(text, parsed, hybrid.lexical_k, allowed))
            if not hybrid.union:
                return [], None
            docs = np.unique(np.concatenate([hits.doc_numbers for hits in found]))
            return [hits.doc_numbers for hits in found], context.reader.submit(docs).records() if len(docs) else None

        future = context.pool.submit(lexical_side)
        dense_texts = [query.dense_text() for query in parsed]  # as Searcher.dense_queries
        pools: list[Scored] = []
        try:
            if embeddings is None:
                embeddings = context.encode(dense_texts)
                timer.lap("encode")
            dense = search_dense(context, embeddings, params, timer, filtered=filtered, extra=future, pools=pools)
        except BaseException:
            _release_unused(future)  # whatever search_dense did not take over (release is idempotent)
            raise
        future.result()  # done: search_dense waited for it
        lexical = found
        results = [_fuse_one(context, text, query, pool, hits, result, params.k, hybrid)
                   for query, pool, hits, result in zip(parsed, pools, lexical, dense)]
        timer.lap("fusion")
        results = mark_truncated(context.encoder, dense_texts, embeddings, results)
        if explain:
            results = explain_results(context, dense_texts, embeddings, results)
    if explain:
        results = [_with_lexical_matches(context, text, query, result) for query, result in zip(parsed, results)]
        timer.lap("explain")
    stage_ms = timer.total()
    used = {**hybrid.to_json(), "rerank_count": params.rerank_count} if hybrid.mode == "hybrid" else None
    for query, result in zip(parsed, results):
        result.stats.stage_ms = stage_ms
        result.stats.mode, result.stats.hybrid = hybrid.mode, used
        result.stats.syntax, result.stats.ignored = query.syntax, list(query.ignored)
    return results


def _release_unused(future: ExtraDocs) -> None:
    """Wait for the lexical side of a failed search and give its read records back."""
    if not future.cancel() and future.exception() is None:
        _, records = future.result()
        if records is not None:
            records.release()


def _lexical_result(context: SearchContext, hits: "LexicalHits", filtered: FilteredDocs | None) -> QueryResult:
    ids = context.ids.external(hits.doc_numbers)
    return QueryResult(
        hits=[Hit(doc_id, float(score), None, None, lexical_score=float(score))
              for doc_id, score in zip(ids, hits.scores.tolist())],
        stats=SearchStats(stage_ms={}, hit_rate=1.0, bytes_read=0, ios=0, prefetched=0, missed=0,
                          engine="", matched=None if filtered is None else filtered.matches))


def _fuse_one(context: SearchContext, text: "TextIndex", query: LexicalQuery,
              pool: tuple[np.ndarray, np.ndarray, np.ndarray], lexical: "LexicalHits", dense: QueryResult, k: int,
              hybrid: HybridParams) -> QueryResult:
    pool_docs, pool_cls, pool_bow = pool
    docs = np.union1d(pool_docs, lexical.doc_numbers)
    dense_scores = np.full(len(docs), np.nan, dtype=np.float32)
    cls = np.full(len(docs), np.nan, dtype=np.float32)
    bow = np.full(len(docs), np.nan, dtype=np.float32)
    where = np.searchsorted(docs, pool_docs)
    cls[where], bow[where] = pool_cls, pool_bow
    dense_scores[where] = context.weight * pool_cls + (1 - context.weight) * pool_bow
    lexical_scores = np.full(len(docs), np.nan, dtype=np.float32)
    lexical_scores[np.searchsorted(docs, lexical.doc_numbers)] = lexical.scores
    if query.constrained:  # + and - hold for the dense side's documents too
        keep = text.satisfying(query, docs)
        docs, dense_scores, lexical_scores, cls, bow = (a[keep] for a in (docs, dense_scores, lexical_scores, cls, bow))
    fused = fuse(docs, dense_scores, lexical_scores, hybrid)
    top = fused.doc[:k].astype(np.int64)
    rows = np.searchsorted(docs, top)
    hits = [Hit(doc_id, float(score), _maybe(cls[row]), _maybe(bow[row]), dense_score=_maybe(d), lexical_score=_maybe(s))
            for doc_id, score, row, d, s in zip(context.ids.external(top), fused.score[:k].tolist(), rows.tolist(),
                                                fused.dense[:k].tolist(), fused.lexical[:k].tolist())]
    return QueryResult(hits=hits, stats=dense.stats)


def _maybe(value: float) -> float | None:
    return None if value != value else float(value)  # NaN: that side has no score


def _with_lexical_matches(context: SearchContext, text: "TextIndex", query: LexicalQuery,
                          result: QueryResult) -> QueryResult:
    hits = []
    for hit in result.hits:
        number = context.ids.internal(hit.doc_id)
        title, body = context.docs.get(number)
        hits.append(dataclasses.replace(hit, lexical_matches=lexical_matches(text, query, number, title, body)))
    return dataclasses.replace(result, hits=hits)
