"""Match explanations: which document word each query vector matched, and how strongly.

Runs after a search and only when asked (`Searcher.search(..., explain=True)`), so the
search pipeline itself does no extra work. For the re-ranked hits it reads their records
once more (one batched read), recomputes each query vector's best match with its argmax,
and asks the encoder where the matched vector came from in the stored passage
(`Encoder.vector_spans`: tokenizer offsets for the generic encoder, the gated whole words
for ColBERTer). For pooled records the pooling groups stored beside them
(`espn.pooling.spans`) say which of those vectors each stored vector merged; a document
without stored groups is re-encoded and pooled again (`pooled_spans`). The per-token
contributions add up to the hit's bow_score.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np
import torch

from ..corpus import PASSAGE_JOINER, index_title_joiner, passage_text
from ..encoders import Encoder, QueryEmbeddings
from ..encoders.base import VectorSpans
from ..errors import InvalidParameterError
from ..maxsim import record_vectors
from ..pages.stored import open_index_images
from ..pooling.cluster import pool_vectors
from ..pooling.groups import merge_group_spans
from ..results import Explanation, PassageSpan, QueryResult, TokenMatch
from ..pooling.spans import open_index_groups, spans_from_groups
from .context import SearchContext

__all__ = ["can_explain", "explain_results", "explain_pages", "passage_spans", "best_matches", "pooled_spans"]

log = logging.getLogger(__name__)


def _explains_pages(encoder: Encoder | None) -> bool:
    """A visual encoder: its explanations are patches of the page (explain_pages)."""
    return encoder is not None and encoder.reads_pages and hasattr(encoder, "page_grid")


def can_explain(encoder: Encoder | None) -> None:
    """Raise InvalidParameterError (naming `explain`) unless the encoder maps vectors to text, or
    to the patches of a page."""
    if _explains_pages(encoder):
        return
    if encoder is None or type(encoder).vector_spans is Encoder.vector_spans:
        kind = "none" if encoder is None else (encoder.kind or type(encoder).__name__)
        raise InvalidParameterError(
            f"explain: this index's encoder ({kind}) cannot map its vectors back to text; search without explain")


def passage_spans(title: str, text: str, spans: Sequence[tuple[int, int]],
                  joiner: str = PASSAGE_JOINER) -> tuple[PassageSpan, ...]:
    """Spans in the encoded passage (`passage_text(title, text, joiner)`, `joiner` the index's) -> spans of its fields.

    A span is placed in the field where it starts and clipped to it (tokenizers never join
    characters across the joiner's punctuation and space, so clipping is a safeguard).
    """
    if not title:
        return tuple(PassageSpan("text", start, min(end, len(text))) for start, end in spans)
    joiner_start, text_start = len(title), len(title) + len(joiner)
    out = []
    for start, end in spans:
        if start < joiner_start:
            out.append(PassageSpan("title", start, min(end, joiner_start)))
        elif start < text_start:
            out.append(PassageSpan("joiner", start - joiner_start, min(end, text_start) - joiner_start))
        else:
            out.append(PassageSpan("text", start - text_start, end - text_start))
    return tuple(out)


def pooled_spans(encoder: Encoder, passages: Sequence[str], spans: list[VectorSpans], factor: int) -> list[VectorSpans]:
    """Spans of records the writer pooled (`store.pool_factor` > 1): re-encode the passages,
    pool their vectors as the writer did (fp16, as the build's chunks hold them; the
    clustering is deterministic) and give each stored vector the spans of every source
    vector it merged, in text order."""
    embedded = encoder.encode_documents(list(passages))
    out: list[VectorSpans] = []
    for (_, bow), source_spans in zip(embedded.split(), spans):
        _, groups = pool_vectors(bow.astype(np.float16), factor)
        # A count mismatch gives no spans: the caller sees it and reports it.
        out.append(merge_group_spans(groups, source_spans) if len(groups) == len(source_spans) else [])
    return out


def best_matches(q_bow: torch.Tensor, pair_query: np.ndarray, vectors: torch.Tensor, offsets: np.ndarray,
                 pair_doc: np.ndarray, chunk: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """MaxSim with its argmax: for pair p and query vector t, the best similarity and the
    document vector that gives it -> best [P, Lq] float32, matched [P, Lq] int64 (record
    order within the document; -1 and 0.0 where the document has no vectors).

    q_bow [B, Lq, D] float32; pair_query, pair_doc [P]; vectors [T, D] float32 with
    document d owning vectors[offsets[d]:offsets[d + 1]]. Pairs go in padded chunks of
    `chunk`, one batched matmul each.
    """
    n_pairs, lq = len(pair_query), int(q_bow.shape[1])
    best = np.zeros((n_pairs, lq), dtype=np.float32)
    matched = np.full((n_pairs, lq), -1, dtype=np.int64)
    lengths = (offsets[pair_doc + 1] - offsets[pair_doc]).astype(np.int64)
    for a in range(0, n_pairs, chunk):
        b = min(a + chunk, n_pairs)
        width = int(lengths[a:b].max()) if b > a else 0
        if width == 0:
            continue
        within = np.arange(width)
        valid = within[None, :] < lengths[a:b, None]  # [c, width]
        index = np.where(valid, offsets[pair_doc[a:b], None] + within[None, :], 0)
        docs = vectors[torch.from_numpy(index)]  # [c, width, D]
        sim = torch.bmm(q_bow[torch.from_numpy(pair_query[a:b])], docs.transpose(1, 2))  # [c, Lq, width]
        sim.masked_fill_(~torch.from_numpy(valid)[:, None, :], float("-inf"))
        values, where = sim.max(dim=2)
        has = lengths[a:b] > 0
        best[a:b][has] = values.numpy()[has]
        matched[a:b][has] = where.numpy()[has]
    return best, matched


def explain_results(context: SearchContext, queries: Sequence[str], q: QueryEmbeddings,
                    results: list[QueryResult]) -> list[QueryResult]:
    """The same results with an Explanation on every re-ranked hit (bow_score not None).

    queries: the B query strings `q` was encoded from; results: one per query, as
    `espn.search.dense.search_dense` returned them. One read of the hits' records, one call each to
    `vector_spans` for the passages and the queries.
    """
    encoder = context.encoder
    if _explains_pages(encoder):
        return explain_pages(context, queries, q, results)
    can_explain(encoder)
    assert encoder is not None
    read = _read_hits(context, results)
    if read is None:
        return results
    targets, docs, vectors, offsets, row_docs, rows = read
    stored = [context.docs.get(int(number)) for number in docs]  # (title, text) per unique document
    joiner = index_title_joiner(context.manifest)  # the passages as the encoder read them
    with context.tokenizer_lock:  # fast tokenizers refuse concurrent reconfiguration
        passages = [passage_text(title, text, joiner) for title, text in stored]
        doc_spans = encoder.vector_spans(passages)
        query_spans = encoder.vector_spans(list(queries), is_query=True)
        query_labels = encoder.vector_labels(list(queries), is_query=True)
        pool_factor = int(context.manifest["store"].get("pool_factor", 1))
        if pool_factor > 1:  # the writer's stored groups; re-encode only documents that have none
            source_spans = doc_spans
            doc_spans = spans_from_groups(
                open_index_groups(context.index, context.view), docs, context.records[docs]["n_bow"], source_spans,
                lambda at: pooled_spans(encoder, [passages[i] for i in at], [source_spans[i] for i in at], pool_factor))
    doc_of_row = np.searchsorted(docs, row_docs)
    pair_query = np.array([i for i, _ in targets], dtype=np.int64)
    best, matched = best_matches(torch.from_numpy(np.asarray(q.bow, dtype=np.float32)), pair_query, vectors,
                                 offsets, rows)
    weight = context.weight
    mean = context.bow_reduction == "mean"
    explained = [list(result.hits) for result in results]
    for p, ((i, j), row) in enumerate(zip(targets, rows)):
        hit = results[i].hits[j]
        columns = np.flatnonzero(q.mask[i])
        similarities, vector_ids = best[p, columns].tolist(), matched[p, columns].tolist()
        scale = 1.0 / max(1, len(columns)) if mean else 1.0
        title, text = stored[int(doc_of_row[row])]
        spans = doc_spans[int(doc_of_row[row])]
        n_vectors = int(offsets[row + 1] - offsets[row])
        if len(spans) != n_vectors:
            log.warning("explain: %s has %d BOW vectors but its encoder gives %d spans (pooled or re-encoded "
                        "differently); its matches carry no spans", hit.doc_id, n_vectors, len(spans))
            spans = [[] for _ in range(n_vectors)]
        q_spans = query_spans[i] if len(query_spans[i]) == len(columns) else [[(0, 0)]] * len(columns)
        labels = (query_labels[i] if query_labels is not None and len(query_labels[i]) == len(columns)
                  else [("text", "")] * len(columns))
        query = queries[i]
        matches = tuple(
            TokenMatch(
                token=query[q_span[0][0]: q_span[0][1]] if q_span else label,
                query_start=q_span[0][0] if q_span else 0,
                query_end=q_span[0][1] if q_span else 0,
                similarity=similarity,
                contribution=similarity * scale,
                vector=vector,
                spans=passage_spans(title, text, spans[vector], joiner) if vector >= 0 else (),
                kind=kind,
            )
            for q_span, (kind, label), similarity, vector in zip(q_spans, labels, similarities, vector_ids)
        )
        bow = float(hit.bow_score)  # type: ignore[arg-type]  # targets have one
        cls = float(hit.cls_score)  # type: ignore[arg-type]  # a re-ranked hit has both
        explained[i][j] = dataclasses.replace(hit, explanation=Explanation(
            weight=weight, cls_part=weight * cls, bow_part=(1 - weight) * bow, matches=matches))
    return [dataclasses.replace(result, hits=hits) for result, hits in zip(results, explained)]


def explain_pages(context: SearchContext, queries: Sequence[str], q: QueryEmbeddings,
                  results: list[QueryResult]) -> list[QueryResult]:
    """`explain_results` for an index of pages: per query vector, the page vector it matched with
    its place in the patch grid (`TokenMatch.row`, `.column`; `Explanation.grid`) and the
    similarity, which is exactly that query vector's MaxSim term. No passage spans. The grid is
    the page's own, kept beside its image (`espn.pages.images`; ColQwen's differs from page to
    page); a page whose record does not hold it (pooled at build time) gets no grid positions.
    """
    encoder = context.encoder
    assert encoder is not None
    read = _read_hits(context, results)
    if read is None:
        return results
    targets, _, vectors, offsets, row_docs, rows = read
    with context.tokenizer_lock:
        fixed = encoder.page_grid()  # type: ignore[attr-defined]
        tokens = encoder.query_tokens(list(queries), q.mask)  # type: ignore[attr-defined]
    stored = open_index_images(context.index, context.view)
    pair_query = np.array([i for i, _ in targets], dtype=np.int64)
    best, matched = best_matches(torch.from_numpy(np.asarray(q.bow, dtype=np.float32)), pair_query, vectors,
                                 offsets, rows)
    weight, mean = context.weight, context.bow_reduction == "mean"
    explained = [list(result.hits) for result in results]
    for p, ((i, j), row) in enumerate(zip(targets, rows)):
        hit = results[i].hits[j]
        columns = np.flatnonzero(q.mask[i])
        scale = 1.0 / max(1, len(columns)) if mean else 1.0
        n_vectors = int(offsets[row + 1] - offsets[row])
        # the grid the page was encoded with, else (written before grids were kept) the model's one grid
        grid = stored.grid(int(row_docs[row])) or fixed
        page_grid = grid if grid is not None and grid.vectors == n_vectors else None
        labels = tokens[i] if tokens is not None and len(tokens[i]) == len(columns) else \
            [("text", "", 0, 0)] * len(columns)
        matches = []
        for (kind, token, start, end), similarity, vector in zip(labels, best[p, columns].tolist(),
                                                                matched[p, columns].tolist()):
            place = page_grid.position(vector) if page_grid is not None and vector >= 0 else None
            matches.append(TokenMatch(token=token, query_start=start, query_end=end, similarity=similarity,
                                      contribution=similarity * scale, vector=vector, spans=(), kind=kind,
                                      row=None if place is None else place[0],
                                      column=None if place is None else place[1]))
        bow = float(hit.bow_score)  # type: ignore[arg-type]  # targets have one
        cls = float(hit.cls_score)  # type: ignore[arg-type]
        explained[i][j] = dataclasses.replace(hit, explanation=Explanation(
            weight=weight, cls_part=weight * cls, bow_part=(1 - weight) * bow, matches=tuple(matches),
            grid=None if page_grid is None else (page_grid.rows, page_grid.columns)))
    return [dataclasses.replace(result, hits=hits) for result, hits in zip(results, explained)]


def _read_hits(context: SearchContext, results: list[QueryResult]) -> tuple[
        list[tuple[int, int]], np.ndarray, torch.Tensor, np.ndarray, np.ndarray, np.ndarray] | None:
    """The re-ranked hits' records, decoded as the search scored them (fp32: int8 codes times
    their scale): (query, hit) targets, their unique doc numbers, vectors and offsets per record
    row, the doc number of each row, and each target's row; None when no hit was re-ranked."""
    targets = [(i, j) for i, result in enumerate(results) for j, hit in enumerate(result.hits)
               if hit.bow_score is not None]
    if not targets:
        return None
    numbers = np.array([context.ids.internal(results[i].hits[j].doc_id) for i, j in targets], dtype=np.int64)
    docs = np.unique(numbers)
    with context.reader.submit(docs).records() as records:
        vectors, offsets = record_vectors(records, context.layout)
        return targets, docs, vectors.cpu(), offsets, records.docs.copy(), records.rows_of(numbers)
