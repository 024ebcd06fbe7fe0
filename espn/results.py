"""What a search returns: plain dataclasses the server and CLI turn into JSON and run files."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["Hit", "SearchStats", "QueryResult", "Document", "PassageSpan", "TokenMatch", "Explanation", "LexicalMatch"]


@dataclasses.dataclass(frozen=True)
class PassageSpan:
    """Characters [start, end) of one field of a stored passage.

    field: "title", "text", or "joiner" (the ". " the encoder saw between title and text).
    """

    field: str
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class TokenMatch:
    """What one query vector found in a document.

    token:        the query text the vector came from (query[query_start:query_end])
    similarity:   its best dot product with a document BOW vector (MaxSim's max)
    contribution: its share of the hit's bow_score (similarity, divided by the number of
                  query vectors when the index averages them); the contributions sum to bow_score
    vector:       the document's BOW vector it matched, in record order (-1: the document has none)
    spans:        where that vector came from in the passage (several for a pooled word;
                  empty when the encoder cannot say)
    kind:         "text" (a token of the query), or for a ColBERT checkpoint's vectors that come
                  from no query text, "special" ([CLS], [SEP]), "marker" (the query marker) or
                  "expansion" (a [MASK] padding token); `token` is then the token's name
    row, column:  for a page (an index of page images): the matched vector's place in the page's
                  patch grid (`Explanation.grid`), 0-based from the top left; None for a vector of
                  the visual prompt, or for text
    """

    token: str
    query_start: int
    query_end: int
    similarity: float
    contribution: float
    vector: int
    spans: tuple[PassageSpan, ...]
    kind: str = "text"
    row: int | None = None
    column: int | None = None


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Why a re-ranked hit scored what it did: score = cls_part + bow_part.

    cls_part = weight · cls_score, bow_part = (1 − weight) · bow_score; matches: one per query vector.
    grid: for a page, (rows, columns) of its patch grid, which the matches' row and column index
    (a heatmap: cell (row, column) of a page cut into that grid); None for text.
    """

    weight: float
    cls_part: float
    bow_part: float
    matches: tuple[TokenMatch, ...]
    grid: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class LexicalMatch:
    """A clause of the query that matched a document on the lexical side.

    terms:        its analysed terms (space-joined for a phrase)
    query_start, query_end: where it was written in the query
    score:        its BM25 contribution; the matches' scores sum to the hit's lexical_score
    spans:        where its words occur in the passage
    """

    terms: str
    query_start: int
    query_end: int
    score: float
    spans: tuple[PassageSpan, ...]


@dataclasses.dataclass(frozen=True)
class Hit:
    """One ranked document. `bow_score` is None below `rerank_count` (not re-ranked).

    In dense mode `score` is `w·cls + (1−w)·bow`. In lexical mode it is the BM25 score
    (`cls_score` and `bow_score` None). In hybrid mode it is the fused score, with
    `dense_score` (`w·cls + (1−w)·bow`, None when the dense side did not score it) and
    `lexical_score` (BM25, None when the lexical side did not find it) beside it.

    `explanation` (MaxSim, re-ranked hits) and `lexical_matches` (the lexical side) are
    filled only by `Searcher.search(..., explain=True)`.
    """

    doc_id: str
    score: float
    cls_score: Optional[float]
    bow_score: Optional[float]
    explanation: Optional[Explanation] = None
    dense_score: Optional[float] = None
    lexical_score: Optional[float] = None
    lexical_matches: Optional[tuple[LexicalMatch, ...]] = None


@dataclasses.dataclass
class SearchStats:
    """Where the time went for one query's batch, and what the prefetcher achieved for it.

    stage_ms:   milliseconds per stage of the batch (encode, quantizer, ann, prefetch_wait,
                miss_read, gather, maxsim, aggregate, total); shared by the queries of a batch
    hit_rate:   prefetched ∩ final candidates / final candidates (1.0 when nothing to re-rank)
    bytes_read: this query's share of the batch's reads in bytes (prefetch + misses)
    ios:        this query's share of the batch's read requests
    prefetched: documents the prefetch waves read for this query
    missed:     final candidates read in the critical path
    read_amplification: documents read for this query ÷ documents re-ranked (1.0 = no waste)
    engine:     what moved the bytes ("io_uring", "aio", "threads" under posix; else the reader)
    waves:      prefetch waves the batch started; waves_skipped: those the cost model skipped
    matched:    documents the search's filter admits (None: no filter)
    filter_path: "exact" (every matching document scored), "ivf" (the matches' lists probed
                in coarse order), "centroids" (the centroid first stage kept only matching
                documents, espn.first_stage.centroids) or "all" (every document matches: searched
                unfiltered); None without a filter
    mode:       dense, lexical or hybrid (see espn.search.hybrid)
    hybrid:     in hybrid mode, the fusion parameters the search used and its rerank_count
                (the router re-fuses partitions' pools with them)
    syntax:     lexical and hybrid: how the query was read ("plain" or "simple")
    ignored:    what the simple syntax read as text instead of as syntax (an unclosed quote,
                an operator before another), one line each; empty when nothing was
    query_truncated: the query was longer than the model's query length and was cut, as the
                model family does (espn.search.long_queries); query_read_chars: how many of its
                characters the model read (None: not known, or not cut)
    """

    stage_ms: dict[str, float]
    hit_rate: float
    bytes_read: int
    ios: int
    prefetched: int
    missed: int
    read_amplification: float = 1.0
    engine: str = ""
    waves: int = 0
    waves_skipped: int = 0
    matched: Optional[int] = None
    filter_path: Optional[str] = None
    mode: str = "dense"
    hybrid: Optional[dict] = None
    syntax: Optional[str] = None
    ignored: list[str] = dataclasses.field(default_factory=list)
    query_truncated: bool = False
    query_read_chars: Optional[int] = None


@dataclasses.dataclass
class QueryResult:
    hits: list[Hit]
    stats: SearchStats


@dataclasses.dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)  # as written ({} when none)
