"""`AsyncClient`: the espn HTTP API from async code.

    from espn_client import AsyncClient

    async with AsyncClient("http://localhost:8000", api_key="...") as espn:
        answer = await espn.search("what causes ocean tides", k=5, filter={"topic": "oceans"})
        hits = answer.results

The source of both clients: client.py (`Client`) is generated from this file by
clients/python/scripts/unasync.py, which takes out `async` and `await` and swaps the waiting
primitives (_async_io for _sync_io). Edit this file, then run the script; tests/test_client.py
fails while client.py is not what the script writes. The calls and their answers are built and
checked by code both share (_core.py, _exchange.py).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Iterable, Mapping, Optional, Sequence, TypeVar, Union

import httpx

from ._async_io import gather, sleep, within
from ._core import (DEFAULT_MAX_BODY_BYTES, DEFAULT_TIMEOUT_S, Answer, Call, DocumentCalls, RetryPolicy, Routes,
                    Upsert, auth_headers, batch_call, chunk_writes, chunks, merge_batches, query_list, search_call,
                    search_params)
from ._exchange import ACCEPT_ENCODING, DEFAULT_DEADLINE_S, DEFAULT_MAX_ANSWER_BYTES, Exchange
from .errors import ApiError, TransportError
from .models import (BatchSearchResponse, Document, Health, IndexInfo, Readiness, SearchResponse, ServerLimits,
                     SnapshotInfo, WriteResponse)

__all__ = ["AsyncClient"]

T = TypeVar("T")


class AsyncClient:
    """A connection pool to one espn server (and one of its indexes).

    base_url: e.g. "http://localhost:8000". api_key: the server's ESPN_API_KEY, sent as
    `Authorization: Bearer <key>`. index: None for today's routes (`/v1/search`, ...), or the
    name of an index of a server that holds several (`/v1/indexes/{name}/search`, ...).
    timeout: seconds for connecting, sending, each read and a pooled connection (or an
    `httpx.Timeout`). deadline_s: seconds a whole call may take, its tries, their waits and the
    reading of its answer together (None: no deadline). max_answer_bytes: the most bytes of one
    answer's body held, counted after decompression. retry: when 503 and 507 answers are retried.
    concurrency: how many requests `search_many` and `get_documents` keep in flight.
    http_client: an `httpx.AsyncClient` of your own (proxies, TLS, transports); not closed here.
    It belongs to one event loop.

    Errors are `espn_client.EspnError` subclasses carrying the answer's status and the start of
    its body; an error status is an `ApiError` with the server's `code` and `message`."""

    def __init__(self, base_url: str, *, api_key: Optional[str] = None, index: Optional[str] = None,
                 timeout: Union[float, httpx.Timeout] = DEFAULT_TIMEOUT_S,
                 deadline_s: Optional[float] = DEFAULT_DEADLINE_S, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
                 retry: RetryPolicy = RetryPolicy(), headers: Optional[Mapping[str, str]] = None,
                 http_client: Optional[httpx.AsyncClient] = None, concurrency: int = 4) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency: at least 1, got {concurrency}")
        if deadline_s is not None and not deadline_s > 0:
            raise ValueError(f"deadline_s: seconds above 0, or None for no deadline; got {deadline_s!r}")
        if max_answer_bytes < 1:
            raise ValueError(f"max_answer_bytes: at least 1, got {max_answer_bytes}")
        self.base_url = base_url.rstrip("/")
        self.index = index
        self.timeout = timeout
        self.deadline_s = deadline_s
        self.max_answer_bytes = max_answer_bytes
        self.retry = retry
        self.concurrency = concurrency
        self._routes = Routes(index)
        self._calls = DocumentCalls(self._routes)
        self._headers = auth_headers(api_key, headers, ACCEPT_ENCODING)
        self._owned = http_client is None
        self._http = http_client if http_client is not None else httpx.AsyncClient(timeout=timeout)
        self._limits: Optional[ServerLimits] = None

    # -- the transport loop ------------------------------------------------------------------

    async def _send(self, call: Call[T]) -> T:
        """The call's result: tried again after a 503, a 507 or a connection never opened (as the
        retry policy and the deadline allow); every failure an `EspnError`."""
        exchange = Exchange(call, self.base_url, self.timeout, self.retry, self.deadline_s, self.max_answer_bytes)
        return await within(exchange, lambda: self._tries(exchange))

    async def _tries(self, exchange: Exchange[T]) -> T:
        while True:
            try:
                return exchange.result(await self._answer(exchange))
            except (httpx.HTTPError, ApiError) as failure:
                await sleep(exchange.wait_after(failure))

    async def _answer(self, exchange: Exchange[T]) -> Answer:
        """One try: the request sent and its answer read, streamed, within the exchange's limits."""
        call = exchange.call
        request = self._http.build_request(call.method, exchange.url, json=call.body, headers=self._headers,
                                           timeout=exchange.start())
        response = await self._http.send(request, stream=True)
        try:
            reader = exchange.read(response)
            try:
                if reader.already_read:
                    reader.feed(response.content)
                else:
                    async for chunk in response.aiter_raw():
                        if not reader.feed(chunk):
                            break
            except httpx.HTTPError as exc:
                raise reader.broken(exc) from exc
            return reader.answer()
        finally:
            await response.aclose()

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
        """POST /v1/search: one query. params: any other parameter of the API (nprobe,
        rerank_count, fusion, ...; see `espn_client.SearchParams`); unset ones keep the index's
        defaults. explain: per-hit explanations (k <= 100)."""
        return await self._send(search_call(self._routes, query, explain,
                                            search_params(k, filter, mode, return_text, params)))

    async def search_batch(self, queries: Sequence[str], k: Optional[int] = None, *,
                           filter: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None,
                           return_text: Optional[bool] = None, **params: Any) -> BatchSearchResponse:
        """POST /v1/search/batch: several queries in one request (at most the server's
        max_batch_queries; `search_many` splits longer lists). A query that cannot be searched
        is an entry of `errors`; the others are answered."""
        return await self._send(batch_call(self._routes, queries, search_params(k, filter, mode, return_text, params)))

    async def search_many(self, queries: Sequence[str], k: Optional[int] = None, *,
                          filter: Optional[Mapping[str, Any]] = None, mode: Optional[str] = None,
                          return_text: Optional[bool] = None, chunk_size: Optional[int] = None,
                          **params: Any) -> BatchSearchResponse:
        """Any number of queries, sent as batches of `chunk_size` (default: the server's
        max_batch_queries, read once from its OpenAPI document), `concurrency` batches in flight;
        one answer, `index` counted over the whole list."""
        body = search_params(k, filter, mode, return_text, params)
        size = chunk_size or (await self.limits()).max_batch_queries
        calls = [batch_call(self._routes, part, body) for part in chunks(query_list(queries), size)]
        answers = await gather([functools.partial(self._send, call) for call in calls], self.concurrency)
        return merge_batches([(at * size, answer) for at, answer in enumerate(answers)])

    # -- documents -------------------------------------------------------------------------

    async def get_document(self, doc_id: str) -> Document:
        """GET /v1/documents/{id}: title, text and metadata (NotFoundError if absent)."""
        return await self._send(self._calls.get(doc_id))

    async def get_documents(self, doc_ids: Iterable[str], *, missing_ok: bool = False) -> dict[str, Document]:
        """Several documents by id, one request each, `concurrency` at a time; missing_ok: leave out
        absent ids instead of raising."""
        async def get(doc_id: str) -> Optional[Document]:
            try:
                return await self.get_document(doc_id)
            except ApiError as error:
                if not (missing_ok and error.status_code == 404):
                    raise
                return None

        ids = list(doc_ids)
        documents = await gather([functools.partial(get, doc_id) for doc_id in ids], self.concurrency)
        return {doc_id: document for doc_id, document in zip(ids, documents) if document is not None}

    async def put_document(self, doc_id: str, text: Optional[str] = None, *, title: str = "",
                           metadata: Optional[Mapping[str, Any]] = None,
                           image: Optional[bytes] = None) -> WriteResponse:
        """PUT /v1/documents/{id}: add it, or replace the document with this id. image: on an index
        of pages, the page (PNG, JPEG or WebP bytes; text then optional)."""
        return await self._send(self._calls.put(doc_id, text, title, metadata, image))

    async def get_page_image(self, doc_id: str, *, max_side: Optional[int] = None) -> tuple[bytes, str]:
        """GET /v1/documents/{id}?image=true: a page's stored image and its media type (a thumbnail at
        most `max_side` px a side); NotFoundError for an unknown id or a document without one."""
        return await self._send(self._calls.page_image(doc_id, max_side))

    async def delete_document(self, doc_id: str) -> WriteResponse:
        """DELETE /v1/documents/{id} (NotFoundError for an unknown id)."""
        return await self._send(self._calls.delete(doc_id))

    async def write_documents(self, upsert: Iterable[Upsert] = (), delete: Iterable[str] = ()) -> WriteResponse:
        """POST /v1/documents/batch: upserts (DocumentUpsert or dicts with id, text, title,
        metadata) and deletes published as one generation, all or nothing."""
        return await self._send(self._calls.batch(upsert, delete))

    async def write_many(self, upsert: Iterable[Upsert] = (), delete: Iterable[str] = (), *,
                         chunk_size: Optional[int] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
                         ) -> list[WriteResponse]:
        """Any number of upserts and deletes, as batches the server takes (at most `chunk_size`
        of each, default the server's max_batch_writes, and bodies under `max_body_bytes`), sent
        in order, one at a time. Each batch is its own generation: if one fails, the batches
        before it stay written."""
        size = chunk_size or (await self.limits()).max_batch_writes
        batches = chunk_writes(upsert, delete, size, max_body_bytes)
        return [await self._send(self._calls.batch(u, d)) for u, d in batches]

    # -- snapshots and the server ------------------------------------------------------------

    async def create_snapshot(self, name: Optional[str] = None) -> SnapshotInfo:
        """POST /v1/snapshots: a consistent copy under the server's --snapshot-dir."""
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
        `--model NAME=SPEC`); it then takes writes through a client made with `index=name`. Nothing is
        trained (the index fits itself on its own documents as it grows), so it answers within a second
        once the model is loaded; loading a model may take longer, hence a time limit of its own
        (timeout_s, default 600 s), and it is not retried. `ConflictError` when the name is taken,
        `InvalidRequestError` for an unknown model (the message lists the configured ones)."""
        return await self._send(self._calls.create_index(name, model, timeout_s))

    async def refit_index(self, name: str) -> IndexInfo:
        """POST /v1/indexes/{name}/refit: fit the index on its own documents again, in the background
        (searches and writes go on). It answers once the re-fit has started; `get_index`'s
        `fit["refit_running"]` shows its progress until it ends. `ConflictError` for an index
        served read-only."""
        return await self._send(self._calls.refit_index(name))

    async def delete_index(self, name: str) -> None:
        """DELETE /v1/indexes/{name}: the index's requests finish, it closes and its directory is removed
        (`NotFoundError` for an unknown name; `ConflictError` for the server's default index)."""
        await self._send(self._calls.delete_index(name))

    async def health(self) -> Health:
        """GET /healthz: the process answers."""
        return await self._send(self._calls.health())

    async def ready(self) -> Readiness:
        """GET /readyz: `.ready` is False while the server starts, warms or drains (a 503, not an error)."""
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
            await sleep(poll_s)

    async def metrics(self) -> str:
        """GET /metrics: the Prometheus text."""
        return await self._send(self._calls.metrics())

    async def limits(self) -> ServerLimits:
        """The server's batch limits, read once from its /openapi.json."""
        if self._limits is None:
            self._limits = await self._send(self._calls.limits())
        return self._limits
