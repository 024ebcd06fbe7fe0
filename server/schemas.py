"""Request and response models of the HTTP API, with explicit bounds.

Requests are strict (`"k": "10"` is a type error, not 10) and closed (`extra="forbid"`:
a misspelled parameter is an error, not silently ignored). The bounds here are the
HTTP contract, published in the OpenAPI document: whatever its JSON Schema admits the
server accepts, and what it refuses the server refuses (tests/test_openapi.py runs
Schemathesis against a real server to hold both). So integers follow JSON Schema (1.0 is
an integer), and rules that a pydantic `pattern` would check with a different regex
engine are checked here in Python, with the same character classes the schema spells out.
Rules that depend on the index (nprobe <= nlist, the filter's fields) are added to the
document by server/openapi.py; rules between fields that JSON Schema cannot state (an id
twice in one write) are 409s, documented as such.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Annotated, Any, Callable, Literal, Optional

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from starlette.requests import Request

from espn.engine import RULES, SearchOptions as EngineOptions

from .index_schemas import CreateIndexRequest, IndexInfo, IndexListResponse

__all__ = [
    "MAX_QUERY_CHARS",
    "MAX_HTTP_K",
    "MAX_ID_BYTES",
    "MAX_BATCH_QUERIES",
    "SearchOptions",
    "IndexInfo",
    "IndexListResponse",
    "CreateIndexRequest",
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
    "QueryError",
    "DocumentResponse",
    "HealthResponse",
    "ReadinessResponse",
    "ErrorResponse",
]

# The same limits as the library's where the concept is the same: a query's characters
# (espn.params.MAX_QUERY_CHARS) and an id's UTF-8 bytes (espn.ids.MAX_ID_BYTES).
#: Results per query over HTTP: below the library's `espn.params.MAX_K` (10,000), because a
#: response is built whole in memory and sent as one JSON body: 1,000 hits with their
#: titles and texts are already megabytes, and a batch multiplies them
#: (docs/guides/operating-limits.md).
MAX_HTTP_K = 1000
MAX_QUERY_CHARS = RULES.max_query_chars
MAX_ID_BYTES = RULES.max_id_bytes
# Hard ceiling of the schema; ServerSettings.max_batch_queries (<= this) is the live limit.
MAX_BATCH_QUERIES = 10_000
# An explanation holds one entry per query token per hit: explained responses stay small.
MAX_EXPLAIN_K = 100
#: Lexical candidates of a hybrid search over HTTP: below the library's
#: `espn.params.MAX_LEXICAL_K` (10,000), because each one the dense side did not find is
#: read from the SSD and MaxSim-scored within the request, and `espn route` asks every partition
#: of a hybrid search for its whole pool (docs/guides/operating-limits.md).
MAX_HTTP_LEXICAL_K = 1000

# Python's str.isspace() characters, spelled out: a JSON Schema pattern is an ECMA regex,
# whose \s is another set, and the library tests blankness with str.strip().
_SPACE = r"\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
BLANK_PATTERN = f"^[{_SPACE}]*$"
# "Not blank" as JSON Schema: `not` a blank string (Schemathesis' coverage phase draws from it
# reliably, which it does not from the equivalent negated character class).
NOT_BLANK: dict[str, Any] = {"not": {"pattern": BLANK_PATTERN}}
# An id: no surrounding whitespace (the library strips nothing, it refuses), no control characters.
_ID_EDGE = r"\x00-\x20\x7f-\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
WRITE_ID_PATTERN = f"^[^{_ID_EDGE}](?:[^\\x00-\\x1f\\x7f-\\x9f]*[^{_ID_EDGE}])?$"
_BLANK = re.compile(BLANK_PATTERN)
_WRITE_ID = re.compile(WRITE_ID_PATTERN)


def _non_blank(value: str) -> str:
    if _BLANK.fullmatch(value):
        raise ValueError("must contain a non-whitespace character")
    return value


def path_doc_id(request: Request) -> str:
    """The id in a /v1/documents/{id} or /v1/indexes/{index}/documents/{id} URL exactly as sent:
    the raw path after the route's own segments, percent-decoded to bytes, then strict UTF-8 and
    the id rules (InvalidParameterError, a 422, naming the problem). Starlette's decoding would
    turn invalid bytes into U+FFFD, so two different ids could collide; an index name holds no '/'."""
    raw: bytes = request.scope.get("raw_path") or request.url.path.encode("utf-8")
    segments = 5 if "index" in request.path_params else 3  # "", v1, [indexes, NAME,] documents
    tail = raw.split(b"/", segments)[-1]
    return RULES.decode_doc_id(urllib.parse.unquote_to_bytes(tail))


def check_write_id(value: str) -> str:
    """The library's own words for what is wrong (`espn.ids`); the pattern is what the schema states."""
    problem = RULES.id_problem(value)
    if problem is None and not _WRITE_ID.fullmatch(value):
        problem = "has leading or trailing whitespace or a control character"
    if problem is not None:
        raise ValueError(f"an id {problem}")
    return value


def _integral(value: Any) -> Any:
    """JSON Schema's integer includes 1.0: an integral float is an int; "1", true and 1.5 stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


_INTEGRAL = BeforeValidator(_integral)  # after the bounds in Annotated[...]: the schema keeps minimum/maximum
Integer = Annotated[int, _INTEGRAL]
def _has_text(value: str) -> str:
    if not RULES.has_text(value):
        raise ValueError("must contain a character to search (not only whitespace or control characters)")
    return value


# A query: what the search accepts (espn.params.has_text), stated in the schema as well.
QueryText = Annotated[str, Field(min_length=1, max_length=MAX_QUERY_CHARS,
                                 json_schema_extra={"not": {"pattern": RULES.no_text_pattern}}), AfterValidator(_has_text)]
# An id's limit is the library's, in UTF-8 bytes, checked by check_write_id in the library's words;
# JSON Schema counts characters, so the schema states the bound it implies (a byte is at most a
# character) and a longer id gets the library's message, not pydantic's.
ID_SCHEMA: dict[str, Any] = {"maxLength": MAX_ID_BYTES, "pattern": WRITE_ID_PATTERN}
#: How the docs and the schema's descriptions name the limit.
ID_LIMIT = f"at most {MAX_ID_BYTES} UTF-8 bytes"
WriteId = Annotated[str, Field(min_length=1, json_schema_extra=ID_SCHEMA), AfterValidator(check_write_id)]
# An id to delete: the schema states the write rule (every stored id obeys it, so no other id can be
# deleted); the writer checks it and answers 422 `invalid_parameter` naming what is wrong.
DocId = Annotated[str, Field(min_length=1, max_length=MAX_ID_BYTES, json_schema_extra={"pattern": WRITE_ID_PATTERN})]


class SearchOptions(BaseModel):
    """Parameters shared by /v1/search and /v1/search/batch; None keeps the index default."""

    model_config = ConfigDict(extra="forbid", strict=True)

    k: Integer = Field(10, ge=1, le=MAX_HTTP_K, description="results per query")
    # Bounds inside the Optional: on the outer Field they would not reach the integer branch of the schema.
    nprobe: Optional[Annotated[int, Field(ge=1, le=1 << 20), _INTEGRAL]] = Field(
        None, description="IVF clusters visited (<= nlist)")
    prefetch_step: Optional[float] = Field(
        None, gt=0.0, le=1.0, allow_inf_nan=False, description="fraction of nprobe after which prefetching starts"
    )
    prefetch_k: Optional[Annotated[int, Field(ge=0, le=RULES.max_prefetch_k), _INTEGRAL]] = Field(
        None, description="candidates each prefetch wave reads")
    rerank_count: Optional[Annotated[int, Field(ge=0, le=RULES.max_rerank), _INTEGRAL]] = Field(
        None, description="candidates re-ranked with MaxSim")
    prefetch_waves: Optional[Annotated[int, Field(ge=1, le=1000), _INTEGRAL]] = Field(
        None, description="most prefetch waves (1 = one prefetch)")
    prefetch: Optional[bool] = Field(None, description="false: read candidates after the ANN (faster on small CPUs)")
    first_stage: Optional[Literal["ivf", "centroids", "union"]] = Field(
        None, description="candidate generator: ivf (the CLS vector's IVF), centroids (token-level centroids, the "
                          "default of ColBERT/PyLate indexes) or union (both); centroids needs an index built with them")
    first_stage_probe: Optional[Annotated[int, Field(ge=1, le=RULES.max_probe), _INTEGRAL]] = Field(
        None, description="centroids each query token visits (first_stage centroids or union)")
    first_stage_candidates: Optional[Annotated[int, Field(ge=1, le=RULES.max_candidates), _INTEGRAL]] = Field(
        None, description="documents the centroid stage hands to MaxSim")
    return_text: bool = Field(False, description="include each hit's title and text")
    filter: Optional[dict[str, Any]] = Field(
        None, description='metadata filter every hit satisfies, e.g. {"topic": "oceans", "year": {"gte": 2000}}; '
                          'operators in, not_in, gt, gte, lt, lte, exists; and, or, not (see espn.filters)')
    mode: Optional[Literal["dense", "lexical", "hybrid"]] = Field(
        None, description='dense (vectors; the default), lexical (BM25 over the full-text index) or hybrid (both, '
                          'fused); an index built without a full-text index answers lexical and hybrid with 422')
    syntax: Optional[Literal["plain", "simple"]] = Field(
        None, description='lexical and hybrid: how a query is read. plain (default): text, every character a word or '
                          'punctuation, never an operator or an error; the dense side reads it as typed. simple: '
                          '"phrases", +required and -excluded words; an unclosed quote or a dangling operator is read '
                          'as text and stats.ignored says so')
    fusion: Optional[Literal["rrf", "mix", "zscore"]] = Field(
        None, description="hybrid: reciprocal rank fusion, the min-max normalised mix of the two scores, or the "
                          "z-score normalised mix (default: the index's)")
    lexical_k: Optional[Annotated[int, Field(ge=1, le=MAX_HTTP_LEXICAL_K), _INTEGRAL]] = Field(
        None, description="hybrid: candidates from the lexical side")
    rrf_k: Optional[Annotated[int, Field(ge=1, le=100_000), _INTEGRAL]] = Field(None, description="hybrid: the RRF constant")
    mix_weight: Optional[float] = Field(None, ge=0.0, le=1.0, allow_inf_nan=False,
                                        description="hybrid: the dense side's weight in the mix (default: calibrated)")
    union: Optional[bool] = Field(None, description="hybrid: MaxSim-score what only the lexical side found")

    def engine_options(self, explain: bool = False) -> EngineOptions:
        """These options as the engine takes them (espn.engine.SearchOptions)."""
        return EngineOptions.from_fields({**dict(self), "explain": explain})


class SearchRequest(SearchOptions):
    # explain: true needs k <= MAX_EXPLAIN_K, which JSON Schema states with if/then.
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"explain": {"const": True}}, "required": ["explain"]},
        "then": {"properties": {"k": {"maximum": MAX_EXPLAIN_K}}}})

    query: QueryText = Field(description="query text")
    explain: Optional[bool] = Field(
        None, description=f"explain each re-ranked hit: per query token its MaxSim contribution and the passage "
                          f"span it matched (k <= {MAX_EXPLAIN_K})")

    @model_validator(mode="after")
    def _check_explain(self) -> "SearchRequest":
        if self.explain and self.k > MAX_EXPLAIN_K:
            raise ValueError(f"explain: at most k={MAX_EXPLAIN_K} hits can be explained, got k={self.k}")
        return self


class BatchSearchRequest(SearchOptions):
    # Each text is checked on its own (blank, too long): a bad one is an entry of the answer's
    # `errors`, the others are answered.
    queries: list[str] = Field(min_length=1, max_length=MAX_BATCH_QUERIES,
                               description=f"query texts; one that is blank or over {MAX_QUERY_CHARS} characters is "
                                           "not searched and answered in `errors`")


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
    kind: str = Field("text", description='"text" (query text), or a vector from no text (ColBERT checkpoints): '
                      '"special" ([CLS], [SEP]), "marker" (the query marker), "expansion" ([MASK] padding)')
    row: Optional[int] = Field(None, description="pages: the matched patch's row in `grid` (absent: a prompt vector)")
    column: Optional[int] = Field(None, description="pages: the matched patch's column in `grid`")


class ExplanationModel(BaseModel):
    weight: float = Field(description="w in score = w · cls_score + (1 − w) · bow_score")
    cls_part: float = Field(description="w · cls_score")
    bow_part: float = Field(description="(1 − w) · bow_score")
    matches: list[TokenMatchModel] = Field(description="one per query vector")
    grid: Optional[list[int]] = Field(None, description="pages: [rows, columns] of the page's patch grid (absent: text)")

    @model_validator(mode="before")
    @classmethod
    def _unset_when_none(cls, data: Any) -> Any:  # text answers (exclude_unset) stay as they were
        if isinstance(data, dict):  # (grid, row and column are None for text)
            data = {**{k: v for k, v in data.items() if k != "grid" or v is not None}, "matches": [
                {k: v for k, v in dict(m).items() if k not in ("row", "column") or v is not None} for m in data["matches"]]}
        return data


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
    syntax: Optional[str] = Field(default=None, description="lexical and hybrid: how the query was read (plain or "
                                                            "simple)")
    ignored: Optional[list[str]] = Field(
        default=None, description="syntax simple: what was read as text instead of as syntax (an unclosed quote, an "
                                  "operator before another), one line each; absent when nothing was")
    hybrid: Optional[dict[str, Any]] = Field(
        default=None, description="hybrid: the fusion parameters used (fusion, rrf_k, mix_weight, lexical_k, union) "
                                  "and rerank_count, with which a router re-fuses the pools of several partitions")
    query_truncated: Optional[bool] = Field(
        default=None, description="true when the query was longer than the model's query length and was cut, as "
                                  "the model's own library does; absent when the model read all of it")
    query_read_chars: Optional[int] = Field(
        default=None, description="with query_truncated: how many of the query's characters the model read")


class SearchResponse(BaseModel):
    query: str
    index: Optional[int] = Field(default=None, description="batch: the query's position in the request")
    results: list[SearchHit]
    stats: SearchStatsModel


class QueryError(BaseModel):
    index: int = Field(description="the query's position in the request")
    error: str = Field(description="invalid_query (the query cannot be searched as given), internal_error (its "
                       "search failed inside the server; the server's log has the traceback), or the code the "
                       "query would have had alone")
    message: str


class BatchSearchResponse(BaseModel):
    responses: list[SearchResponse] = Field(description="the answered queries, in request order (see `index`)")
    errors: list[QueryError] = Field(default_factory=list, description="one per query that could not be searched; "
                                                                       "the others are answered")


class DocumentResponse(BaseModel):
    id: str
    title: str
    text: str
    metadata: dict[str, Any] = Field(default_factory=dict, description="the metadata object the document was written "
                                     "with ({} when none)")


class HealthResponse(BaseModel):
    status: str
    detail: Optional[str] = None
    reader: Optional[dict[str, Any]] = Field(default=None, description="the embedding reader: name, I/O engine, device, ...")


class ReadinessResponse(HealthResponse):
    """GET /readyz of a server: its index's generation and whether it takes writes."""

    generation: Optional[int] = Field(default=None, description="the live-index generation served (0: as built)")
    mode: Optional[str] = Field(default=None, description='"read-write", or "read-only" (writes get 409)')
    replication: Optional[dict[str, Any]] = Field(
        default=None, description="a follower's (--follow): source, generation, source_generation, lag_generations, "
                                  "lag_seconds, stale (the source was not reached lately), last_error; a writer's "
                                  "(--publish): target, generation, published_generation, lag_generations, "
                                  "lag_seconds, stale (the last publish failed), last_error")
    partition: Optional[dict[str, Any]] = Field(
        default=None, description="which partition of how many this index is, and the rule that places ids "
                                  "(`index`, `count`, `by`); the router checks it before it sends a write")
    trust_remote_code: Optional[bool] = Field(
        default=None, description="whether the index's encoder runs Python code from its model directory (built and "
                                  "served with --trust-remote-code)")
    indexes: Optional[list["IndexInfo"]] = Field(
        default=None, description="with several indexes (`--index NAME=PATH`): each one's state in this worker; "
                                  "readiness is the default index's")


class ErrorResponse(BaseModel):
    """Body of every 4xx/5xx the server sends on purpose."""

    error: str = Field(description="machine-readable code, e.g. invalid_parameter")
    message: str = Field(description="what went wrong, for a human")
    errors: Optional[list[dict[str, Any]]] = Field(None, description="per-field validation errors")


# -- writes to a live index ---------------------------------------------------------------
# The library takes at most 100,000 characters of title and text together; JSON Schema
# cannot bound a sum, so the HTTP contract splits it.
MAX_TITLE_CHARS = 10_000
MAX_TEXT_CHARS = 90_000
MAX_BATCH_WRITES = 1000
_INT64 = (-(1 << 63), (1 << 63) - 1)
# Metadata as the library takes it (espn.metadata.FIELD_NAME and value_type), in JSON Schema.
METADATA_SCHEMA: dict[str, Any] = {
    "propertyNames": {"pattern": r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$", "not": {"enum": ["and", "or", "not"]}},
    "additionalProperties": {"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "number"},
        {"type": "boolean"}, {"type": "null"}]},
}


def _metadata_numbers(value: Any) -> Any:
    """An integer past 64 bits is kept as a float, as a JSON number written 1e20 is: one JSON Schema number."""
    if isinstance(value, dict):
        return {key: float(item) if isinstance(item, int) and not isinstance(item, bool)
                and not _INT64[0] <= item <= _INT64[1] else item for key, item in value.items()}
    return value


def _given(**schema: Any) -> Callable[[dict[str, Any]], None]:
    def extra(field: dict[str, Any]) -> None:  # a field that may be absent, but given is `schema` (never null)
        for key in ("anyOf", "default"):
            field.pop(key, None)
        field.update(schema)
    return extra


class DocumentWrite(BaseModel):
    """The body of PUT /v1/documents/{id}: a passage, or on an index of pages the page (text optional)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [{"required": [f]} for f in ("text", "image")]})

    title: str = Field("", max_length=MAX_TITLE_CHARS)
    text: str = Field("", min_length=1, max_length=MAX_TEXT_CHARS, json_schema_extra=_given(**NOT_BLANK),
                      description="the passage; at least one non-whitespace character (optional beside an image)")
    image: Optional[str] = Field(None, json_schema_extra=_given(type="string", minLength=4, maxLength=RULES.max_base64_chars,
                                 pattern=RULES.base64_pattern, contentEncoding="base64"),
                                 description="pages: the page, PNG, JPEG or WebP in base64 (a 409 on an index of text)")
    metadata: Annotated[Optional[dict[str, Any]], BeforeValidator(_metadata_numbers)] = Field(
        None, json_schema_extra=METADATA_SCHEMA,
        description="stored with the passage and filterable: field names of letters, digits, _ . - (at most 64, "
                    "not and/or/not); values keyword, list of keywords, number, boolean or null. A field given "
                    "another type than the index holds for it is a 409")

    _check_text = field_validator("text")(_non_blank)
    _check_image = field_validator("image", mode="before")(lambda v: RULES.decode_base64_image(v) and v)

    @model_validator(mode="after")
    def _text_or_image(self) -> "DocumentWrite":
        if self.image is None and not self.text:
            raise ValueError("text: required (at least one non-whitespace character) unless image gives a page")
        return self

    def image_bytes(self) -> Optional[bytes]:
        return None if self.image is None else RULES.decode_base64_image(self.image)


class DocumentUpsert(DocumentWrite):
    id: WriteId = Field(description=f"external id: {ID_LIMIT}, no surrounding whitespace, no control characters")


class BatchWriteRequest(BaseModel):
    """POST /v1/documents/batch: every upsert and delete published as one generation."""

    # At least one of the two lists is non-empty; JSON Schema says it with anyOf.
    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [
        {"required": ["upsert"], "properties": {"upsert": {"minItems": 1}}},
        {"required": ["delete"], "properties": {"delete": {"minItems": 1}}}]})

    upsert: list[DocumentUpsert] = Field(default_factory=list, max_length=MAX_BATCH_WRITES,
                                         description="documents to add or replace (an id twice is a 409)")
    delete: list[DocId] = Field(default_factory=list, max_length=MAX_BATCH_WRITES,
                                json_schema_extra={"uniqueItems": True},
                                description="ids to delete (unknown: 404; also upserted here: 409)")

    @model_validator(mode="after")
    def _check_lists(self) -> "BatchWriteRequest":
        if not self.upsert and not self.delete:
            raise ValueError("nothing to write: give documents to upsert or ids to delete")
        if len(set(self.delete)) != len(self.delete):
            raise ValueError("delete: an id is listed twice")
        return self


class WriteResponse(BaseModel):
    generation: int = Field(description="the generation the write published; searches see it from now on")
    created: list[str]
    replaced: list[str]
    deleted: list[str]


ReadinessResponse.model_rebuild()  # its `indexes` names IndexInfo (server.index_schemas)
