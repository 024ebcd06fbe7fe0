"""What the sync and async clients share: routes, request building, answers to models, retries, chunks.

Each public method of `Client` and `AsyncClient` builds a `Call` here (method, path, body, how
its answer becomes a result); the client's transport loop sends it and reads the answer
(_exchange.py bounds that read) into an `Answer`, which `Call.parse` turns into the result.
"""

from __future__ import annotations

import base64
import dataclasses
import email.utils
import codecs
import json
import random
import re
import time
import urllib.parse
from typing import Any, Callable, Generic, Iterable, Iterator, Mapping, Optional, Sequence, TypeVar, Union

import httpx
from pydantic import BaseModel, TypeAdapter

from .models import (CreateIndexRequest, IndexInfo, IndexList, BatchSearchRequest, BatchSearchResponse, BatchWriteRequest, Document, DocumentUpsert,
                     DocumentWrite, Health, Readiness, SearchParams, SearchRequest, SearchResponse, ServerLimits,
                     SnapshotInfo, SnapshotList, SnapshotRequest, WriteResponse)

__all__ = ["RetryPolicy", "Routes", "Answer", "Call", "DocumentCalls", "DEFAULT_TIMEOUT_S", "DEFAULT_MAX_BODY_BYTES", "Upsert",
           "search_params", "search_call", "query_list", "batch_call", "chunks", "chunk_writes", "merge_batches",
           "limits_from_openapi", "retry_after_s", "auth_headers"]

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
#: Any JSON value, parsed by pydantic's own parser (which refuses nesting past its limit).
_JSON = TypeAdapter(Any)
#: Seconds for connect, read, write and pool alike; a search of a cold index can take a second.
DEFAULT_TIMEOUT_S = 30.0
#: POST /v1/indexes runs a build (tens of seconds): its default time limit.
CREATE_INDEX_TIMEOUT_S = 600.0
#: The server's largest request body by default (ESPN_MAX_BODY_BYTES); write helpers stay under it.
DEFAULT_MAX_BODY_BYTES = 1 << 20
Upsert = Union[DocumentUpsert, Mapping[str, Any]]


def user_agent() -> str:
    return "espn-client/0.1.0"


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """When a request is sent again.

    A 503 (not ready, overloaded, index busy, write failed) or a 507 (disk full) is retried up to
    `attempts` tries in all, waiting what the answer's `Retry-After` says, or else
    `backoff_s`, doubled each time up to `max_backoff_s`, with up to 25% jitter. A Retry-After
    longer than `max_retry_after_s` is not waited for: the error is raised at once (the server
    says the wait is an operator's). A connection that could not be opened is retried the
    same way (nothing was sent). Every retried answer means nothing was applied, so writes are
    retried too. `RetryPolicy(attempts=1)` turns retries off."""

    attempts: int = 4
    backoff_s: float = 0.25
    max_backoff_s: float = 8.0
    max_retry_after_s: float = 60.0
    statuses: frozenset[int] = frozenset({503, 507})

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts: at least 1 (1 = no retries), got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0 or self.max_retry_after_s < 0:
            raise ValueError("backoff_s, max_backoff_s and max_retry_after_s must be >= 0")

    def delay_s(self, attempt: int, retry_after_s: Optional[float]) -> Optional[float]:
        """Seconds to wait before try `attempt + 1` (attempt counts from 1), or None: give up."""
        if attempt >= self.attempts:
            return None
        if retry_after_s is not None:
            return retry_after_s if retry_after_s <= self.max_retry_after_s else None
        base = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return base * (1.0 + 0.25 * random.random())


def retry_after_s(value: Optional[str]) -> Optional[float]:
    """`Retry-After` in seconds: delay-seconds or an HTTP date (RFC 9110 10.2.3); None if absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class Routes:
    """The paths of one index. index=None: today's single-index routes (`/v1/search`, ...);
    index="name": the same routes under `/v1/indexes/{name}/` (a server holding several
    indexes). Health, readiness, metrics and the OpenAPI document belong to the server."""

    def __init__(self, index: Optional[str] = None) -> None:
        if index is not None and not index:
            raise ValueError("index: a name, or None for the server's default index")
        self.index = index
        self.v1 = "/v1" if index is None else f"/v1/indexes/{urllib.parse.quote(index, safe='')}"

    @property
    def search(self) -> str:
        return f"{self.v1}/search"

    @property
    def search_batch(self) -> str:
        return f"{self.v1}/search/batch"

    def document(self, doc_id: str) -> str:
        # Every byte but unreserved ones escaped ("/" too): the server reads the id from the raw path.
        if not isinstance(doc_id, str) or not doc_id:
            raise ValueError(f"doc_id: a non-empty string, got {doc_id!r}")
        return f"{self.v1}/documents/{urllib.parse.quote(doc_id, safe='')}"

    @property
    def documents_batch(self) -> str:
        return f"{self.v1}/documents/batch"

    @property
    def snapshots(self) -> str:
        return f"{self.v1}/snapshots"

    indexes = "/v1/indexes"  # the server's, whichever index this client is for

    def named_index(self, name: str) -> str:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: a non-empty string, got {name!r}")
        return f"/v1/indexes/{urllib.parse.quote(name, safe='')}"

    health = "/healthz"
    ready = "/readyz"
    metrics = "/metrics"
    openapi = "/openapi.json"


@dataclasses.dataclass(frozen=True)
class Answer:
    """An answer read whole, within the client's limits: its status, headers and decoded body.
    truncated: an error answer's body cut at the most the client reads of one."""

    status_code: int
    headers: httpx.Headers
    content: bytes
    request: httpx.Request
    truncated: bool = False

    @property
    def method(self) -> str:
        return self.request.method

    @property
    def url(self) -> str:
        return str(self.request.url)

    @property
    def text(self) -> str:
        """The body as text, in the charset its Content-Type names (UTF-8 if none, or one Python lacks)."""
        named = re.search(r"charset=\"?([\w.:-]+)", self.headers.get("content-type", ""))
        charset = "utf-8"
        if named:
            try:
                charset = codecs.lookup(named.group(1)).name
            except LookupError:
                pass
        return self.content.decode(charset, "replace")

    def json(self) -> Any:
        """The body's JSON, parsed by pydantic (nesting deeper than its limit is a ValidationError, a
        ValueError, where the standard library's parser would raise RecursionError)."""
        return _JSON.validate_json(self.content)


@dataclasses.dataclass(frozen=True)
class Call(Generic[T]):
    """One request and how its answer becomes a result. ok: statuses that are answers, not errors
    (readiness: 503 is an answer). retry: False for a call whose 503 is not worth waiting for.
    timeout: seconds for each read and for the whole call, when the call needs longer than the
    client's (a build); None: the client's."""

    method: str
    path: str
    parse: Callable[[Answer], T]
    body: Optional[dict[str, Any]] = None
    ok: frozenset[int] = frozenset({200, 201})
    retry: bool = True
    timeout: Optional[float] = None
    expects: str = ""  # what the answer is, for the message when it is not ("": its model's name)


def model(cls: type[M]) -> Callable[[Answer], M]:
    """An answer's JSON validated into `cls` (pydantic-core parses the bytes itself)."""
    return lambda answer: cls.model_validate_json(answer.content)


def search_params(k: Optional[int], filter: Optional[Mapping[str, Any]], mode: Optional[str],
                  return_text: Optional[bool], params: Mapping[str, Any]) -> dict[str, Any]:
    """The search parameters as a body, checked by name and type (an unknown name raises ValueError here)."""
    given = {"k": k, "filter": dict(filter) if filter is not None else None, "mode": mode,
             "return_text": return_text, **params}
    return SearchParams.model_validate({name: value for name, value in given.items() if value is not None}).body()


def search_call(routes: Routes, query: str, explain: Optional[bool], body: dict[str, Any]) -> Call[SearchResponse]:
    request = SearchRequest.model_validate({**body, "query": query, "explain": explain})
    return Call("POST", routes.search, model(SearchResponse), request.model_dump(exclude_none=True))


def query_list(queries: Sequence[str]) -> list[str]:
    if isinstance(queries, str):
        raise TypeError("queries: a list of query texts, not one string (use search() for one query)")
    return list(queries)


def batch_call(routes: Routes, queries: Sequence[str], body: dict[str, Any]) -> Call[BatchSearchResponse]:
    request = BatchSearchRequest.model_validate({**body, "queries": query_list(queries)})
    return Call("POST", routes.search_batch, model(BatchSearchResponse), request.model_dump(exclude_none=True))


class DocumentCalls:
    """The calls of /v1/documents and /v1/snapshots, and the server's own routes."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def get(self, doc_id: str) -> Call[Document]:
        return Call("GET", self.routes.document(doc_id), model(Document))

    def put(self, doc_id: str, text: Optional[str], title: str, metadata: Optional[Mapping[str, Any]],
            image: Optional[bytes] = None) -> Call[WriteResponse]:
        body = DocumentWrite(text=text, title=title, metadata=dict(metadata) if metadata is not None else None,
                             image=base64.b64encode(image).decode("ascii") if image is not None else None)
        return Call("PUT", self.routes.document(doc_id), model(WriteResponse), body.model_dump(exclude_none=True))

    def page_image(self, doc_id: str, max_side: Optional[int]) -> Call[tuple[bytes, str]]:
        query = "?image=true" + (f"&max_side={int(max_side)}" if max_side is not None else "")
        return Call("GET", self.routes.document(doc_id) + query,
                    lambda r: (r.content, r.headers.get("content-type", "application/octet-stream")),
                    expects="an image")

    def delete(self, doc_id: str) -> Call[WriteResponse]:
        return Call("DELETE", self.routes.document(doc_id), model(WriteResponse))

    def batch(self, upsert: Iterable[Upsert], delete: Iterable[str]) -> Call[WriteResponse]:
        request = BatchWriteRequest(upsert=[_upsert(u) for u in upsert], delete=list(delete))
        return Call("POST", self.routes.documents_batch, model(WriteResponse), request.model_dump(exclude_none=True))

    def create_snapshot(self, name: Optional[str]) -> Call[SnapshotInfo]:
        return Call("POST", self.routes.snapshots, model(SnapshotInfo), SnapshotRequest(name=name).model_dump())

    def list_snapshots(self) -> Call[list[SnapshotInfo]]:
        return Call("GET", self.routes.snapshots, lambda r: SnapshotList.model_validate_json(r.content).snapshots)

    def list_indexes(self) -> Call[list[IndexInfo]]:
        return Call("GET", self.routes.indexes, lambda r: IndexList.model_validate_json(r.content).indexes)

    def get_index(self, name: str) -> Call[IndexInfo]:
        return Call("GET", self.routes.named_index(name), model(IndexInfo))

    def create_index(self, name: str, model_name: str, timeout_s: Optional[float]) -> Call[IndexInfo]:
        body = CreateIndexRequest(name=name, model=model_name).model_dump()
        return Call("POST", self.routes.indexes, model(IndexInfo), body, retry=False,
                    timeout=CREATE_INDEX_TIMEOUT_S if timeout_s is None else timeout_s)

    def refit_index(self, name: str) -> Call[IndexInfo]:
        return Call("POST", f"{self.routes.named_index(name)}/refit", model(IndexInfo), None, retry=False,
                    ok=frozenset({202}))

    def delete_index(self, name: str) -> Call[None]:
        return Call("DELETE", self.routes.named_index(name), lambda r: None, ok=frozenset({204}))

    def health(self) -> Call[Health]:
        return Call("GET", self.routes.health, model(Health))

    def ready(self) -> Call[Readiness]:
        return Call("GET", self.routes.ready, model(Readiness), ok=frozenset({200, 503}), retry=False)

    def metrics(self) -> Call[str]:
        return Call("GET", self.routes.metrics, lambda r: r.text, expects="text")

    def limits(self) -> Call[ServerLimits]:
        return Call("GET", self.routes.openapi, lambda r: limits_from_openapi(r.json()), expects="an OpenAPI document")


def _upsert(document: Upsert) -> DocumentUpsert:
    return document if isinstance(document, DocumentUpsert) else DocumentUpsert.model_validate(dict(document))


def limits_from_openapi(document: Any) -> ServerLimits:
    """The live limits a server publishes in its OpenAPI document (server/openapi.py writes the
    settings into `maxItems`); the defaults where it says nothing. A document that is not an
    OpenAPI object raises ValueError."""
    if not isinstance(document, dict):
        raise ValueError(f"an OpenAPI document is a JSON object, not {type(document).__name__}")
    found: dict[str, int] = {}
    for schema, field, limit in (("BatchSearchRequest", "queries", "max_batch_queries"),
                                 ("BatchWriteRequest", "upsert", "max_batch_writes")):
        value = _member(document, "components", "schemas", schema, "properties", field, "maxItems")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            found[limit] = value
    return ServerLimits(**found)


def _member(document: Any, *path: str) -> Any:
    for name in path:
        document = document.get(name) if isinstance(document, dict) else None
    return document


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    if size < 1:
        raise ValueError(f"chunk_size: at least 1, got {size}")
    for start in range(0, len(items), size):
        yield items[start:start + size]


def chunk_writes(upsert: Iterable[Upsert], delete: Iterable[str], max_items: int,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> list[tuple[list[DocumentUpsert], list[str]]]:
    """Upserts and deletes split into batches the server takes: at most `max_items` of each and a
    body under `max_body_bytes`. An id twice, or both upserted and deleted, raises ValueError
    (in one batch the server refuses it with a 409; split, it would apply both)."""
    documents = [_upsert(u) for u in upsert]
    deletes = list(delete)
    seen: set[str] = set()
    for doc_id in [d.id for d in documents] + deletes:
        if doc_id in seen:
            raise ValueError(f"id {doc_id!r} is given twice (upserted twice, deleted twice, or both)")
        seen.add(doc_id)
    budget = max_body_bytes - 256  # the envelope: {"upsert": [...], "delete": [...]}
    batches: list[tuple[list[DocumentUpsert], list[str]]] = []
    current: tuple[list[DocumentUpsert], list[str]] = ([], [])
    size = 0
    for kind, item, item_bytes in ([(0, d, len(d.model_dump_json(exclude_none=True)) + 1) for d in documents]
                                   + [(1, i, len(json.dumps(i)) + 1) for i in deletes]):
        if item_bytes > budget:
            raise ValueError(f"a document of {item_bytes} bytes does not fit a request body of {max_body_bytes} bytes "
                             "(max_body_bytes; the server's ESPN_MAX_BODY_BYTES)")
        if len(current[kind]) >= max_items or size + item_bytes > budget:
            batches.append(current)
            current, size = ([], []), 0
        current[kind].append(item)  # type: ignore[arg-type]
        size += item_bytes
    if current[0] or current[1]:
        batches.append(current)
    return batches


def merge_batches(parts: Sequence[tuple[int, BatchSearchResponse]]) -> BatchSearchResponse:
    """Answers of consecutive chunks (each with the position of its first query) as one answer,
    with `index` counted over the whole list."""
    responses, errors = [], []
    for offset, part in parts:
        for response in part.responses:
            responses.append(response.model_copy(update={"index": (response.index or 0) + offset}))
        for error in part.errors:
            errors.append(error.model_copy(update={"index": error.index + offset}))
    return BatchSearchResponse(responses=responses, errors=errors)


def auth_headers(api_key: Optional[str], headers: Optional[Mapping[str, str]], accept_encoding: str) -> dict[str, str]:
    """The headers of every request: the client's name, the encodings it reads (those whose inflating
    it bounds), the caller's own, and the API key as a bearer token."""
    out = {"User-Agent": user_agent(), "Accept-Encoding": accept_encoding, **(headers or {})}
    if api_key is not None:
        if not api_key:
            raise ValueError("api_key: the server's ESPN_API_KEY, or None when it has none")
        out["Authorization"] = f"Bearer {api_key}"
    return out
