"""Typed request and result models of the HTTP API, mirroring the server's OpenAPI document.

Written by hand, not generated: the names read well in an application (`SearchHit`, not
`SearchHitModel`), and tests/test_client.py holds them to the document a live server publishes
(every property of every schema the client sends or reads is a field here with the same JSON
types, and nothing more). Bounds are not repeated: the server checks them and answers a 422
that names the parameter, so a client never refuses what a newer server accepts.

Requests are closed (`extra="forbid"`: a misspelled parameter is an error here, before any
request). Results are open (`extra="allow"`): a field a newer server adds is kept, not an
error, and `model_dump(exclude_unset=True)` gives back the JSON the server sent.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "SearchParams", "SearchRequest", "BatchSearchRequest", "DocumentWrite", "DocumentUpsert", "BatchWriteRequest",
    "SnapshotRequest", "PassageSpan", "TokenMatch", "Explanation", "LexicalMatch", "SearchHit", "SearchStats",
    "SearchResponse", "QueryError", "BatchSearchResponse", "Document", "WriteResponse", "Health", "Readiness", "IndexInfo", "IndexList",
    "SnapshotInfo", "SnapshotList", "ErrorBody", "ServerLimits", "CreateIndexRequest",
]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Result(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- requests -----------------------------------------------------------------------------

class SearchParams(_Request):
    """Parameters of /v1/search and /v1/search/batch; None (unset) keeps the index's default.
    Their meaning and bounds: the HTTP API reference (docs/reference/http-api.md)."""

    k: Optional[int] = None
    nprobe: Optional[int] = None
    prefetch_step: Optional[float] = None
    prefetch_k: Optional[int] = None
    rerank_count: Optional[int] = None
    prefetch_waves: Optional[int] = None
    prefetch: Optional[bool] = None
    first_stage: Optional[Literal["ivf", "centroids", "union"]] = None
    first_stage_probe: Optional[int] = None
    first_stage_candidates: Optional[int] = None
    return_text: Optional[bool] = None
    filter: Optional[dict[str, Any]] = None
    mode: Optional[Literal["dense", "lexical", "hybrid"]] = None
    syntax: Optional[Literal["plain", "simple"]] = None
    fusion: Optional[Literal["rrf", "mix", "zscore"]] = None
    lexical_k: Optional[int] = None
    rrf_k: Optional[int] = None
    mix_weight: Optional[float] = None
    union: Optional[bool] = None

    def body(self) -> dict[str, Any]:
        """The JSON body: only what was set (None is the server's default, so it is not sent)."""
        return self.model_dump(exclude_none=True)


class SearchRequest(SearchParams):
    """POST /v1/search."""

    query: str
    explain: Optional[bool] = None


class BatchSearchRequest(SearchParams):
    """POST /v1/search/batch."""

    queries: list[str]


class DocumentWrite(_Request):
    """The body of PUT /v1/documents/{id}: a passage (`text`), or on an index of pages the page
    (`image`: PNG, JPEG or WebP in base64) with an optional text."""

    title: str = ""
    text: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    image: Optional[str] = None


class DocumentUpsert(DocumentWrite):
    """One upsert of POST /v1/documents/batch."""

    id: str


class BatchWriteRequest(_Request):
    """POST /v1/documents/batch: published as one generation (all or nothing)."""

    upsert: list[DocumentUpsert] = Field(default_factory=list)
    delete: list[str] = Field(default_factory=list)


class SnapshotRequest(_Request):
    """POST /v1/snapshots."""

    name: Optional[str] = None


class CreateIndexRequest(_Request):
    """POST /v1/indexes: an empty index named `name`, with the server's configured model `model`."""

    name: str
    model: str


# -- results ------------------------------------------------------------------------------

class PassageSpan(_Result):
    field: str
    start: int
    end: int


class TokenMatch(_Result):
    token: str
    query_start: int
    query_end: int
    similarity: float
    contribution: float
    vector: int
    spans: list[PassageSpan]
    kind: str = "text"
    row: Optional[int] = None  # an index of pages: the matched patch's row in Explanation.grid
    column: Optional[int] = None


class Explanation(_Result):
    """Why a re-ranked hit scored what it did: per query vector, its MaxSim contribution and span."""

    weight: float
    cls_part: float
    bow_part: float
    matches: list[TokenMatch]
    grid: Optional[list[int]] = None  # an index of pages: [rows, columns] of the page's patch grid


class LexicalMatch(_Result):
    terms: str
    query_start: int
    query_end: int
    score: float
    spans: list[PassageSpan]


class SearchHit(_Result):
    """One result. title and text only with return_text; explanation only with explain."""

    id: str
    score: float
    cls_score: Optional[float]
    bow_score: Optional[float]
    dense_score: Optional[float] = None
    lexical_score: Optional[float] = None
    title: Optional[str] = None
    text: Optional[str] = None
    explanation: Optional[Explanation] = None
    lexical_matches: Optional[list[LexicalMatch]] = None


class SearchStats(_Result):
    stage_ms: dict[str, float]
    queue_ms: float
    batch_size: int
    hit_rate: float
    bytes_read: int
    ios: int
    prefetched: int
    missed: int
    read_amplification: float = 1.0
    engine: str = ""
    matched: Optional[int] = None
    filter_path: Optional[str] = None
    mode: Optional[str] = None
    syntax: Optional[str] = None
    ignored: Optional[list[str]] = None
    hybrid: Optional[dict[str, Any]] = None
    query_truncated: Optional[bool] = None
    query_read_chars: Optional[int] = None


class SearchResponse(_Result):
    query: str
    index: Optional[int] = None
    results: list[SearchHit]
    stats: SearchStats


class QueryError(_Result):
    """A query of a batch that was not searched (the others were)."""

    index: int
    error: str
    message: str


class BatchSearchResponse(_Result):
    responses: list[SearchResponse]
    errors: list[QueryError] = Field(default_factory=list)


class Document(_Result):
    """GET /v1/documents/{id}."""

    id: str
    title: str
    text: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class WriteResponse(_Result):
    generation: int
    created: list[str]
    replaced: list[str]
    deleted: list[str]


class Health(_Result):
    """GET /healthz."""

    status: str
    detail: Optional[str] = None
    reader: Optional[dict[str, Any]] = None


class IndexInfo(_Result):
    """One index of a server that holds several (GET /v1/indexes, /readyz)."""

    name: str
    default: bool
    open: bool
    documents: int
    generation: Optional[int] = None
    encoder: str
    mode: Optional[str] = None
    memory_mib: Optional[float] = None
    #: what the index is fitted on (exact, fitted_on_documents, growth_since_fit, refit_running, ...)
    fit: Optional[dict[str, Any]] = None


class IndexList(_Result):
    indexes: list[IndexInfo]


class Readiness(Health):
    """GET /readyz (200 when ready, 503 while starting, warming or draining)."""

    generation: Optional[int] = None
    mode: Optional[str] = None
    replication: Optional[dict[str, Any]] = None
    partition: Optional[dict[str, Any]] = None
    trust_remote_code: Optional[bool] = None
    indexes: Optional[list[IndexInfo]] = None

    @property
    def ready(self) -> bool:
        return self.status == "ready"


class SnapshotInfo(_Result):
    name: str
    generation: int
    files: Optional[int] = None
    linked_bytes: Optional[int] = None
    copied_bytes: Optional[int] = None


class SnapshotList(_Result):
    snapshots: list[SnapshotInfo]


class ErrorBody(_Result):
    """The body of every error the server sends on purpose (raised as `espn_client.ApiError`)."""

    error: str
    message: str
    errors: Optional[list[dict[str, Any]]] = None


class ServerLimits(BaseModel):
    """What one request may hold, as the server's live OpenAPI document states it (its settings
    ESPN_MAX_BATCH_QUERIES and ESPN_MAX_BATCH_WRITES); the batch helpers split work to fit."""

    model_config = ConfigDict(frozen=True)

    max_batch_queries: int = 256
    max_batch_writes: int = 1000
