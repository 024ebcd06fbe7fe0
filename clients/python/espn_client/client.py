"""`Client`: the espn HTTP API from synchronous code (`AsyncClient` in async_client.py is its twin).

    from espn_client import Client

    with Client("http://localhost:8000", api_key="...") as espn:
        hits = espn.search("what causes ocean tides", k=5, filter={"topic": "oceans"}).results
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping, Optional, Sequence, TypeVar, Union

import httpx

from ._core import (DEFAULT_MAX_BODY_BYTES, DEFAULT_TIMEOUT_S, Call, DocumentCalls, RetryPolicy, Routes, Upsert,
                    auth_headers, batch_call, chunk_writes, chunks, merge_batches, query_list, search_call,
                    search_params)
from .errors import ApiError, RequestTimeoutError, TransportError
from .models import (IndexInfo, BatchSearchResponse, Document, Health, Readiness, SearchResponse, ServerLimits, SnapshotInfo,
                     WriteResponse)

__all__ = ["Client"]

T = TypeVar("T")


class Client:
    """A connection pool to one espn server (and one of its indexes).

    base_url: e.g. "http://localhost:8000". api_key: the server's ESPN_API_KEY, sent as
    `Authorization: Bearer <key>`. index: None for today's routes (`/v1/search`, ...), or the
    name of an index of a server that holds several (`/v1/indexes/{name}/search`, ...).
    timeout: seconds (or an `httpx.Timeout`). retry: when 503 and 507 answers are retried.
    http_client: an `httpx.Client` of your own (proxies, TLS, transports); it is not closed here.

    Thread-safe: one Client can serve the threads of an application. Errors are
    `espn_client.ApiError` subclasses carrying the server's `code` and `message`."""

    def __init__(self, base_url: str, *, api_key: Optional[str] = None, index: Optional[str] = None,
                 timeout: Union[float, httpx.Timeout] = DEFAULT_TIMEOUT_S, retry: RetryPolicy = RetryPolicy(),
                 headers: Optional[Mapping[str, str]] = None, http_client: Optional[httpx.Client] = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.index = index
        self.retry = retry
        self.timeout = timeout
        self._api_key = api_key
        self._routes = Routes(index)
        self._calls = DocumentCalls(self._routes)
        self._headers = auth_headers(api_key, headers)
        self._owned = http_client is None
        self._http = http_client if http_client is not None else httpx.Client(timeout=timeout)
        self._limits: Optional[ServerLimits] = None

    # -- the transport loop ----------------------------------------------------------------

    def _send(self, call: Call[T]) -> T:
        attempt = 0
        while True:
            attempt += 1
            try:
                response = self._http.request(call.method, self.base_url + call.path, json=call.body,
                                              headers=self._headers,
                                              timeout=self.timeout if call.timeout is None else call.timeout)
            except httpx.TimeoutException as exc:
                raise RequestTimeoutError(f"{call.method} {call.path}: no answer within the timeout ({exc})") from exc
            except httpx.ConnectError as exc:
                wait = self.retry.delay_s(attempt, None) if call.retry else None
                if wait is None:
                    raise TransportError(f"{call.method} {self.base_url}{call.path}: {exc}") from exc
                time.sleep(wait)
                continue
            except httpx.TransportError as exc:
                raise TransportError(f"{call.method} {self.base_url}{call.path}: {exc}") from exc
            try:
                return call.result(response)
            except ApiError as error:
                wait = (self.retry.delay_s(attempt, error.retry_after_s)
                        if call.retry and error.status_code in self.retry.statuses else None)
                if wait is None:
                    raise
                time.sleep(wait)

    def close(self) -> None:
        if self._owned:
            self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        index = f", index={self.index!r}" if self.index is not None else ""
        return f"Client({self.base_url!r}{index})"

    # -- search ----------------------------------------------------------------------------

    def search(self, query: str, k: Optional[int] = None, *, filter: Optional[Mapping[str, Any]] = None,
               mode: Optional[str] = None, return_text: Optional[bool] = None, explain: Optional[bool] = None,
               **params: Any) -> SearchResponse:
        """POST /v1/search: one query. params: any other parameter of the API (nprobe,
        rerank_count, fusion, ...; see `espn_client.SearchParams`); unset ones keep the index's
        defaults. explain: per-hit explanations (k <= 100)."""
        return self._send(search_call(self._routes, query, explain, search_params(k, filter, mode, return_text, params)))

    def search_batch(self, queries: Sequence[str], k: Optional[int] = None, *,
                     filter: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None,
                     return_text: Optional[bool] = None, **params: Any) -> BatchSearchResponse:
        """POST /v1/search/batch: several queries in one request (at most the server's
        max_batch_queries; `search_many` splits longer lists). A query that cannot be searched
        is an entry of `errors`; the others are answered."""
        return self._send(batch_call(self._routes, queries, search_params(k, filter, mode, return_text, params)))

    def search_many(self, queries: Sequence[str], k: Optional[int] = None, *,
                    filter: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None,
                    return_text: Optional[bool] = None, chunk_size: Optional[int] = None,
                    **params: Any) -> BatchSearchResponse:
        """Any number of queries, sent as batches of `chunk_size` (default: the server's
        max_batch_queries, read once from its OpenAPI document); one answer, `index` counted
        over the whole list."""
        body = search_params(k, filter, mode, return_text, params)
        size = chunk_size or self.limits().max_batch_queries
        parts = [(offset * size, self._send(batch_call(self._routes, part, body)))
                 for offset, part in enumerate(chunks(query_list(queries), size))]
        return merge_batches(parts)

    # -- documents -------------------------------------------------------------------------

    def get_document(self, doc_id: str) -> Document:
        """GET /v1/documents/{id}: title, text and metadata (NotFoundError if absent)."""
        return self._send(self._calls.get(doc_id))

    def get_documents(self, doc_ids: Iterable[str], *, missing_ok: bool = False) -> dict[str, Document]:
        """Several documents by id, one request each; missing_ok: leave out absent ids instead of raising."""
        found: dict[str, Document] = {}
        for doc_id in doc_ids:
            try:
                found[doc_id] = self.get_document(doc_id)
            except ApiError as error:
                if not (missing_ok and error.status_code == 404):
                    raise
        return found

    def put_document(self, doc_id: str, text: Optional[str] = None, *, title: str = "",
                     metadata: Optional[Mapping[str, Any]] = None, image: Optional[bytes] = None) -> WriteResponse:
        """PUT /v1/documents/{id}: add it, or replace the document with this id. image: on an index
        of pages, the page (PNG, JPEG or WebP bytes; text then optional)."""
        return self._send(self._calls.put(doc_id, text, title, metadata, image))

    def get_page_image(self, doc_id: str, *, max_side: Optional[int] = None) -> tuple[bytes, str]:
        """GET /v1/documents/{id}?image=true: a page's stored image and its media type (a thumbnail at
        most `max_side` px a side); NotFoundError for an unknown id or a document without one."""
        return self._send(self._calls.page_image(doc_id, max_side))

    def delete_document(self, doc_id: str) -> WriteResponse:
        """DELETE /v1/documents/{id} (NotFoundError for an unknown id)."""
        return self._send(self._calls.delete(doc_id))

    def write_documents(self, upsert: Iterable[Upsert] = (), delete: Iterable[str] = ()) -> WriteResponse:
        """POST /v1/documents/batch: upserts (DocumentUpsert or dicts with id, text, title,
        metadata) and deletes published as one generation, all or nothing."""
        return self._send(self._calls.batch(upsert, delete))

    def write_many(self, upsert: Iterable[Upsert] = (), delete: Iterable[str] = (), *,
                   chunk_size: Optional[int] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
                   ) -> list[WriteResponse]:
        """Any number of upserts and deletes, as batches the server takes (at most `chunk_size`
        of each, default the server's max_batch_writes, and bodies under `max_body_bytes`).
        Each batch is its own generation: if one fails, the batches before it stay written."""
        size = chunk_size or self.limits().max_batch_writes
        return [self._send(self._calls.batch(u, d)) for u, d in chunk_writes(upsert, delete, size, max_body_bytes)]

    # -- snapshots and the server ------------------------------------------------------------

    def create_snapshot(self, name: Optional[str] = None) -> SnapshotInfo:
        """POST /v1/snapshots: a consistent copy under the server's --snapshot-dir."""
        return self._send(self._calls.create_snapshot(name))

    def list_snapshots(self) -> list[SnapshotInfo]:
        """GET /v1/snapshots."""
        return self._send(self._calls.list_snapshots())

    def list_indexes(self) -> list[IndexInfo]:
        """GET /v1/indexes: every index the server holds (name, documents, encoder, open), the default first."""
        return self._send(self._calls.list_indexes())

    def get_index(self, name: str) -> IndexInfo:
        """GET /v1/indexes/{name}: one index (a 404 `NotFoundError` for a name the server does not hold)."""
        return self._send(self._calls.get_index(name))

    def create_index(self, name: str, model: str, timeout_s: Optional[float] = None) -> IndexInfo:
        """POST /v1/indexes: a new, empty index `name` with the server's configured model `model` (its
        `--model NAME=SPEC`); it then takes writes through `Client(url, index=name)`. A build: tens of
        seconds, so it has a time limit of its own (timeout_s, default 600 s). `ConflictError` when the
        name is taken, `InvalidRequestError` for an unknown model (the message lists the configured ones)."""
        return self._send(self._calls.create_index(name, model, timeout_s))

    def delete_index(self, name: str) -> None:
        """DELETE /v1/indexes/{name}: the index's requests finish, it closes and its directory is removed
        (`NotFoundError` for an unknown name; `ConflictError` for the server's default index)."""
        self._send(self._calls.delete_index(name))

    def health(self) -> Health:
        """GET /healthz: the process answers."""
        return self._send(self._calls.health())

    def ready(self) -> Readiness:
        """GET /readyz: `.ready` is False while the server starts, warms or drains (a 503, not an error)."""
        return self._send(self._calls.ready())

    def wait_until_ready(self, timeout_s: float = 60.0, poll_s: float = 0.2) -> Readiness:
        """Poll /readyz until the server is ready; TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                readiness = self.ready()
                if readiness.ready:
                    return readiness
            except TransportError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.base_url} not ready after {timeout_s} s")
            time.sleep(poll_s)

    def metrics(self) -> str:
        """GET /metrics: the Prometheus text."""
        return self._send(self._calls.metrics())

    def limits(self) -> ServerLimits:
        """The server's batch limits, read once from its /openapi.json."""
        if self._limits is None:
            self._limits = self._send(self._calls.limits())
        return self._limits
