"""Request and response models of the HTTP API, with explicit bounds.

Requests are strict (`"k": "10"` is a type error, not 10) and closed (`extra="forbid"`:
a misspelled parameter is an error, not silently ignored). The bounds here are the
HTTP contract; the library checks its own (e.g. nprobe <= nlist) and its
InvalidParameterError becomes a 422 as well.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

__all__ = [
    "MAX_QUERY_CHARS",
    "MAX_K",
    "MAX_BATCH_QUERIES",
    "SearchOptions",
    "SearchRequest",
    "BatchSearchRequest",
    "SearchHit",
    "PassageSpanModel",
    "TokenMatchModel",
    "ExplanationModel",
    "LexicalMatchModel",
    "SearchStatsModel",
    "SearchResponse",
    "BatchSearchResponse",
    "DocumentResponse",
    "HealthResponse",
    "ErrorResponse",
]

MAX_QUERY_CHARS = 4096
MAX_K = 1000
# Hard ceiling of the schema; ServerSettings.max_batch_queries (<= this) is the live limit.
MAX_BATCH_QUERIES = 10_000
MAX_DOC_ID_CHARS = 512
# An explanation holds one entry per query token per hit: explained responses stay small.
MAX_EXPLAIN_K = 100
# Lexical candidates of a hybrid search are read and MaxSim-scored: bounded like rerank_count's work.
MAX_LEXICAL_K = 1000

QueryText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_QUERY_CHARS)]


def _non_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("query must contain a non-whitespace character")
    return value


class SearchOptions(BaseModel):
    """Parameters shared by /v1/search and /v1/search/batch; None keeps the index default."""

    model_config = ConfigDict(extra="forbid", strict=True)

    k: int = Field(10, ge=1, le=MAX_K, description="results per query")
    nprobe: Optional[int] = Field(None, ge=1, le=1 << 20, description="IVF clusters visited (<= nlist)")
    prefetch_step: Optional[float] = Field(
        None, gt=0.0, le=1.0, allow_inf_nan=False, description="fraction of nprobe after which prefetching starts"
    )
    prefetch_k: Optional[int] = Field(None, ge=0, le=10_000, description="candidates each prefetch wave reads")
    rerank_count: Optional[int] = Field(None, ge=0, le=10_000, description="candidates re-ranked with MaxSim")
    prefetch_waves: Optional[int] = Field(None, ge=1, le=1000, description="most prefetch waves (1 = one prefetch)")
    prefetch: Optional[bool] = Field(None, description="false: read candidates after the ANN (faster on small CPUs)")
    return_text: bool = Field(False, description="include each hit's title and text")
    filter: Optional[dict[str, Any]] = Field(
        None, description='metadata filter every hit satisfies, e.g. {"topic": "oceans", "year": {"gte": 2000}}; '
                          'operators in, not_in, gt, gte, lt, lte, exists; and, or, not (see espn.filters)')
    mode: Optional[Literal["dense", "lexical", "hybrid"]] = Field(
        None, description='dense (vectors; the default), lexical (BM25 over the full-text index) or hybrid (both, '
                          'fused). Lexical and hybrid queries read "phrases", +required and -excluded words; an index '
                          'built without a full-text index answers them with 422')
    fusion: Optional[Literal["rrf", "mix"]] = Field(
        None, description="hybrid: reciprocal rank fusion, or the normalised mix of the two scores (default: the "
                          "index's)")
    lexical_k: Optional[int] = Field(None, ge=1, le=MAX_LEXICAL_K, description="hybrid: candidates from the lexical side")
    rrf_k: Optional[int] = Field(None, ge=1, le=100_000, description="hybrid: the RRF constant")
    mix_weight: Optional[float] = Field(None, ge=0.0, le=1.0, allow_inf_nan=False,
                                        description="hybrid: the dense side's weight in the mix (default: calibrated)")
    union: Optional[bool] = Field(None, description="hybrid: MaxSim-score what only the lexical side found")

    def search_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Searcher.search (None = index default)."""
        return {
            "k": self.k,
            "nprobe": self.nprobe,
            "prefetch_step": self.prefetch_step,
            "prefetch_k": self.prefetch_k,
            "rerank_count": self.rerank_count,
            "prefetch_waves": self.prefetch_waves,
            "prefetch": self.prefetch,
            **self.mode_kwargs(),
        }

    def mode_kwargs(self) -> dict[str, Any]:
        """The mode and fusion keyword arguments (None = index default)."""
        return {"mode": self.mode, "fusion": self.fusion, "lexical_k": self.lexical_k, "rrf_k": self.rrf_k,
                "mix_weight": self.mix_weight, "union": self.union}


class SearchRequest(SearchOptions):
    query: QueryText = Field(description="query text")
    explain: Optional[bool] = Field(
        None, description=f"explain each re-ranked hit: per query token its MaxSim contribution and the passage "
                          f"span it matched (k <= {MAX_EXPLAIN_K})")

    _check_query = field_validator("query")(_non_blank)

    @model_validator(mode="after")
    def _check_explain(self) -> "SearchRequest":
        if self.explain and self.k > MAX_EXPLAIN_K:
            raise ValueError(f"explain: at most k={MAX_EXPLAIN_K} hits can be explained, got k={self.k}")
        return self


class BatchSearchRequest(SearchOptions):
    queries: list[QueryText] = Field(min_length=1, max_length=MAX_BATCH_QUERIES, description="query texts")

    @field_validator("queries")
    @classmethod
    def _check_queries(cls, values: list[str]) -> list[str]:
        for value in values:
            _non_blank(value)
        return values


class PassageSpanModel(BaseModel):
    field: str = Field(description='"title", "text", or "joiner" (the ". " encoded between title and text)')
    start: int = Field(description="first character in that field")
    end: int = Field(description="one past the last character")


class TokenMatchModel(BaseModel):
    token: str = Field(description="the query text of this query vector")
    query_start: int
    query_end: int
    similarity: float = Field(description="best dot product with a document vector")
    contribution: float = Field(description="its share of bow_score; the contributions sum to bow_score")
    vector: int = Field(description="the matched document vector, in record order (-1: none)")
    spans: list[PassageSpanModel] = Field(description="where the matched vector came from in the passage")


class ExplanationModel(BaseModel):
    weight: float = Field(description="w in score = w · cls_score + (1 − w) · bow_score")
    cls_part: float = Field(description="w · cls_score")
    bow_part: float = Field(description="(1 − w) · bow_score")
    matches: list[TokenMatchModel] = Field(description="one per query vector")


class LexicalMatchModel(BaseModel):
    terms: str = Field(description="the analysed terms of a query clause that matched (space-joined for a phrase)")
    query_start: int
    query_end: int
    score: float = Field(description="its BM25 contribution; the matches sum to lexical_score")
    spans: list[PassageSpanModel] = Field(description="where its words occur in the passage")


class SearchHit(BaseModel):
    id: str
    score: float = Field(description="dense: w · cls + (1 − w) · bow; lexical: BM25; hybrid: the fused score")
    cls_score: Optional[float] = Field(description="None in lexical mode, and in hybrid for what the dense side did "
                                                   "not score")
    bow_score: Optional[float] = Field(description="None below rerank_count (not re-ranked)")
    dense_score: Optional[float] = Field(default=None, description="hybrid: the dense side's score")
    lexical_score: Optional[float] = Field(default=None, description="lexical and hybrid: BM25 (None: not found by it)")
    title: Optional[str] = None
    text: Optional[str] = None
    explanation: Optional[ExplanationModel] = Field(default=None, description="with explain: true, on re-ranked hits")
    lexical_matches: Optional[list[LexicalMatchModel]] = Field(
        default=None, description="with explain: true in lexical and hybrid modes: what the lexical side matched")


class SearchStatsModel(BaseModel):
    stage_ms: dict[str, float] = Field(description="milliseconds per stage of the batch this query ran in")
    queue_ms: float = Field(description="milliseconds the query waited for its micro-batch")
    batch_size: int = Field(description="queries in the Searcher.search call this query ran in")
    hit_rate: float = Field(description="prefetched ∩ final candidates / final candidates")
    bytes_read: int
    ios: int
    prefetched: int
    missed: int
    # Defaults: the router still parses answers of shards that predate these fields (rolling upgrades).
    read_amplification: float = Field(default=1.0, description="documents read / documents re-ranked (1.0 = no waste)")
    engine: str = Field(default="", description="what moved the bytes: io_uring, aio, threads (posix) or the reader's name")
    matched: Optional[int] = Field(default=None, description="documents the filter admits (absent without a filter)")
    filter_path: Optional[str] = Field(
        default=None, description="exact: every matching document scored; ivf: the matches' lists probed; "
                                  "all: every document matches")
    mode: Optional[str] = Field(default=None, description="lexical or hybrid (absent: dense)")
    hybrid: Optional[dict[str, Any]] = Field(
        default=None, description="hybrid: the fusion parameters used (fusion, rrf_k, mix_weight, lexical_k, union) "
                                  "and rerank_count, with which a router re-fuses the pools of several partitions")


class SearchResponse(BaseModel):
    query: str
    results: list[SearchHit]
    stats: SearchStatsModel


class BatchSearchResponse(BaseModel):
    responses: list[SearchResponse]


class DocumentResponse(BaseModel):
    id: str
    title: str
    text: str


class HealthResponse(BaseModel):
    status: str
    detail: Optional[str] = None
    reader: Optional[dict[str, Any]] = Field(default=None, description="the embedding reader: name, I/O engine, device, ...")


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx the server sends on purpose."""

    error: str = Field(description="machine-readable code, e.g. invalid_parameter")
    message: str = Field(description="what went wrong, for a human")
    errors: Optional[list[dict[str, Any]]] = Field(None, description="per-field validation errors")


# -- writes to a live index ---------------------------------------------------------------
MAX_TEXT_CHARS = 100_000
MAX_BATCH_WRITES = 1000


class DocumentWrite(BaseModel):
    """The body of PUT /v1/documents/{id}."""

    model_config = ConfigDict(extra="forbid")

    title: str = Field("", max_length=MAX_TEXT_CHARS)
    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)
    metadata: Optional[dict[str, Any]] = Field(None, description="stored with the passage (JSON object)")


class DocumentUpsert(DocumentWrite):
    id: str = Field(min_length=1, max_length=MAX_DOC_ID_CHARS)


class BatchWriteRequest(BaseModel):
    """POST /v1/documents/batch: every upsert and delete published as one generation."""

    model_config = ConfigDict(extra="forbid")

    upsert: list[DocumentUpsert] = Field(default_factory=list, max_length=MAX_BATCH_WRITES)
    delete: list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_DOC_ID_CHARS)]] = Field(
        default_factory=list, max_length=10 * MAX_BATCH_WRITES)


class WriteResponse(BaseModel):
    generation: int = Field(description="the generation the write published; searches see it from now on")
    created: list[str]
    replaced: list[str]
    deleted: list[str]
