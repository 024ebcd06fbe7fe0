"""`AsyncClient`: the espn HTTP API from asyncio code, the twin of `Client` (client.py).

    from espn_client import AsyncClient

    async with AsyncClient("http://localhost:8000", api_key="...") as espn:
        hits = (await espn.search("what causes ocean tides", k=5, filter={"topic": "oceans"})).results

Every method has the sync one's name, parameters and result; the calls and their answers are
built by the same code (_core.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Iterable, Mapping, Optional, Sequence, TypeVar, Union

import httpx

from ._core import (DEFAULT_MAX_BODY_BYTES, DEFAULT_TIMEOUT_S, Call, DocumentCalls, RetryPolicy, Routes, Upsert,
                    auth_headers, batch_call, chunk_writes, chunks, merge_batches, query_list, search_call,
                    search_params)
from .errors import ApiError, RequestTimeoutError, TransportError
from .models import (IndexInfo, BatchSearchResponse, Document, Health, Readiness, SearchResponse, ServerLimits, SnapshotInfo,
                     WriteResponse)

__all__ = ["AsyncClient"]

T = TypeVar("T")


class AsyncClient:
    """A connection pool to one espn server (and one of its indexes), for one event loop.

    The parameters are `Client`'s; http_client is an `httpx.AsyncClient` of your own (not
    closed here). concurrency: how many requests `search_many` and `get_documents` keep in
    flight. Errors are `espn_client.ApiError` subclasses carrying the server's `code` and
    `message`."""

    def __init__(self, base_url: str, *, api_key: Optional[str] = None, index: Optional[str] = None,
                 timeout: Union[float, httpx.Timeout] = DEFAULT_TIMEOUT_S, retry: RetryPolicy = RetryPolicy(),
                 headers: Optional[Mapping[str, str]] = None, http_client: Optional[httpx.AsyncClient] = None,
                 concurrency: int = 4) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency: at least 1, got {concurrency}")
        self.base_url = base_url.rstrip("/")
        self.index = index
        self.retry = retry
        self.timeout = timeout
        self.concurrency = concurrency
        self._routes = Routes(index)
        self._calls = DocumentCalls(self._routes)
        self._headers = auth_headers(api_key, headers)
        self._owned = http_client is None
        self._http = http_client if http_client is not None else httpx.AsyncClient(timeout=timeout)
        self._limits: Optional[ServerLimits] = None

    # -- the transport loop (Client._send's, awaiting) ---------------------------------------

    async def _send(self, call: Call[T]) -> T:
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._http.request(call.method, self.base_url + call.path, json=call.body,
                                                    headers=self._headers,
                                                    timeout=self.timeout if call.timeout is None else call.timeout)
            except httpx.TimeoutException as exc:
                raise RequestTimeoutError(f"{call.method} {call.path}: no answer within the timeout ({exc})") from exc
            except httpx.ConnectError as exc:
                wait = self.retry.delay_s(attempt, None) if call.retry else None
                if wait is None:
                    raise TransportError(f"{call.method} {self.base_url}{call.path}: {exc}") from exc
                await asyncio.sleep(wait)
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
                await asyncio.sleep(wait)

    async def _gather(self, awaitables: list[Awaitable[T]]) -> list[T]:
        """The results in order, at most `concurrency` awaited at once; the first error is raised."""
        gate = asyncio.Semaphore(self.concurrency)

        async def gated(awaitable: Awaitable[T]) -> T:
            async with gate:
                return await awaitable

        return list(await asyncio.gather(*(gated(a) for a in awaitables)))

    async def close(self) -> None:
        if self._owned:
            await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    def __repr__(self) -> str:
        index = f", index={self.index!r}" if self.index is not None else ""
        return f"AsyncClient({self.base_url!r}{index})"

    # -- search ----------------------------------------------------------------------------

    async def search(self, query: str, k: Optional[int] = None, *, filter: Optional[Mapping[str, Any]] = None,
                     mode: Optional[str] = None, return_text: Optional[bool] = None, explain: Optional[bool] = None,
                     **params: Any) -> SearchResponse:
        """POST /v1/search (see `Client.search`)."""
        return await self._send(search_call(self._routes, query, explain,
                                            search_params(k, filter, mode, return_text, params)))

    async def search_batch(self, queries: Sequence[str], k: Optional[int] = None, *,
                           filter: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None,
                           return_text: Optional[bool] = None, **params: Any) -> BatchSearchResponse:
        """POST /v1/search/batch (see `Client.search_batch`)."""
        return await self._send(batch_call(self._routes, queries, search_params(k, filter, mode, return_text, params)))

    async def search_many(self, queries: Sequence[str], k: Optional[int] = None, *,
                          filter: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None,
                          return_text: Optional[bool] = None, chunk_size: Optional[int] = None,
                          **params: Any) -> BatchSearchResponse:
        """Any number of queries as batches of `chunk_size` (default the server's max_batch_queries),
        `concurrency` batches in flight; one answer, `index` counted over the whole list."""
        body = search_params(k, filter, mode, return_text, params)
        size = chunk_size or (await self.limits()).max_batch_queries
        calls = [batch_call(self._routes, part, body) for part in chunks(query_list(queries), size)]
        answers = await self._gather([self._send(call) for call in calls])
        return merge_batches([(at * size, answer) for at, answer in enumerate(answers)])

    # -- documents -------------------------------------------------------------------------

    async def get_document(self, doc_id: str) -> Document:
        """GET /v1/documents/{id} (NotFoundError if absent)."""
        return await self._send(self._calls.get(doc_id))

    async def get_documents(self, doc_ids: Iterable[str], *, missing_ok: bool = False) -> dict[str, Document]:
        """Several documents by id, `concurrency` requests at a time; missing_ok: leave out absent ids."""
        async def get(doc_id: str) -> Optional[Document]:
            try:
                return await self.get_document(doc_id)
            except ApiError as error:
                if not (missing_ok and error.status_code == 404):
                    raise
                return None

        ids = list(doc_ids)
        documents = await self._gather([get(doc_id) for doc_id in ids])
        return {doc_id: document for doc_id, document in zip(ids, documents) if document is not None}

    async def put_document(self, doc_id: str, text: Optional[str] = None, *, title: str = "",
                           metadata: Optional[Mapping[str, Any]] = None, image: Optional[bytes] = None) -> WriteResponse:
        """PUT /v1/documents/{id}: add it, or replace the document with this id. image: on an index
        of pages, the page (PNG, JPEG or WebP bytes; text then optional)."""
        return await self._send(self._calls.put(doc_id, text, title, metadata, image))

    async def get_page_image(self, doc_id: str, *, max_side: Optional[int] = None) -> tuple[bytes, str]:
        """GET /v1/documents/{id}?image=true: a page's stored image and its media type."""
        return await self._send(self._calls.page_image(doc_id, max_side))

    async def delete_document(self, doc_id: str) -> WriteResponse:
        """DELETE /v1/documents/{id} (NotFoundError for an unknown id)."""
        return await self._send(self._calls.delete(doc_id))

    async def write_documents(self, upsert: Iterable[Upsert] = (), delete: Iterable[str] = ()) -> WriteResponse:
        """POST /v1/documents/batch: one generation, all or nothing (see `Client.write_documents`)."""
        return await self._send(self._calls.batch(upsert, delete))

    async def write_many(self, upsert: Iterable[Upsert] = (), delete: Iterable[str] = (), *,
                         chunk_size: Optional[int] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
                         ) -> list[WriteResponse]:
        """Batches the server takes, sent in order one at a time (see `Client.write_many`)."""
        size = chunk_size or (await self.limits()).max_batch_writes
        return [await self._send(self._calls.batch(u, d)) for u, d in chunk_writes(upsert, delete, size, max_body_bytes)]

    # -- snapshots and the server ------------------------------------------------------------

    async def create_snapshot(self, name: Optional[str] = None) -> SnapshotInfo:
        """POST /v1/snapshots."""
        return await self._send(self._calls.create_snapshot(name))

    async def list_snapshots(self) -> list[SnapshotInfo]:
        """GET /v1/snapshots."""
        return await self._send(self._calls.list_snapshots())

    async def list_indexes(self) -> list[IndexInfo]:
        """GET /v1/indexes: every index the server holds (name, documents, encoder, open), the default first."""
        return await self._send(self._calls.list_indexes())

    async def get_index(self, name: str) -> IndexInfo:
        """GET /v1/indexes/{name}: one index (a 404 `NotFoundError` for a name the server does not hold)."""
        return await self._send(self._calls.get_index(name))

    async def create_index(self, name: str, model: str, timeout_s: Optional[float] = None) -> IndexInfo:
        """POST /v1/indexes: a new, empty index `name` with the server's configured model `model` (its
        `--model NAME=SPEC`); it then takes writes through `Client(url, index=name)`. A build: tens of
        seconds, so it has a time limit of its own (timeout_s, default 600 s). `ConflictError` when the
        name is taken, `InvalidRequestError` for an unknown model (the message lists the configured ones)."""
        return await self._send(self._calls.create_index(name, model, timeout_s))

    async def delete_index(self, name: str) -> None:
        """DELETE /v1/indexes/{name}: the index's requests finish, it closes and its directory is removed
        (`NotFoundError` for an unknown name; `ConflictError` for the server's default index)."""
        await self._send(self._calls.delete_index(name))

    async def health(self) -> Health:
        """GET /healthz."""
        return await self._send(self._calls.health())

    async def ready(self) -> Readiness:
        """GET /readyz (`.ready` False on a 503)."""
        return await self._send(self._calls.ready())

    async def wait_until_ready(self, timeout_s: float = 60.0, poll_s: float = 0.2) -> Readiness:
        """Poll /readyz until the server is ready; TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                readiness = await self.ready()
                if readiness.ready:
                    return readiness
            except TransportError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.base_url} not ready after {timeout_s} s")
            await asyncio.sleep(poll_s)

    async def metrics(self) -> str:
        """GET /metrics: the Prometheus text."""
        return await self._send(self._calls.metrics())

    async def limits(self) -> ServerLimits:
        """The server's batch limits, read once from its /openapi.json."""
        if self._limits is None:
            self._limits = await self._send(self._calls.limits())
        return self._limits
