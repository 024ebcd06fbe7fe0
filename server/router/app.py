"""The router: one endpoint in front of an index split into partitions.

`espn index CORPUS --out DIR --partitions S` writes S complete indexes that share one
encoder and one projection, so a score from one partition compares with a score from
another. Each partition is served by `espn serve` (replicas behind one address each: a
Kubernetes Service, a load balancer). The router fans every query out to all of them at
once, waits at most `timeout_ms` for each, and merges their top-k by score. A partition
that errors or does not answer in time is left out: the answer is then marked
`"partial": true` and names the missing partitions in `failed_shards`, instead of the
whole request failing or waiting on the slowest machine.

Exactness: partition p returns its own top-k, so the merged top-k is the top-k of the
union. When every partition's candidate pool is exhaustive (nprobe = nlist and
rerank_count >= its documents) that is exactly the ranking of one index over the whole
corpus. With smaller pools each partition re-ranks its own top `rerank_count`, so the
union re-ranks S x rerank_count candidates, a superset of one index's pool.

Lexical and hybrid modes. A lexical search merges by BM25 score like a dense one. A hybrid
search cannot merge fused scores (RRF ranks and min-max normalisations are per list), so
the router asks every partition for its whole fusion pool (`k` = 1000; a partition returns
at most rerank_count + lexical_k hits) with both sides' scores, rebuilds the pool one index
would form (the top rerank_count by dense score, the top lexical_k by BM25) and fuses it
with `espn.hybrid.fuse`, the Searcher's own function, under the parameters the partitions
report. What remains different from one index is BM25's corpus statistics (document
frequencies, average length), which each partition computes over its own documents: with
documents spread by a hash of their ids they differ by sampling noise only. Measured on 2
partitions of 300 SciFact abstracts (tests/test_router.py): the same top-10 set on most queries, and
every routed hybrid ranking within the tolerance stated there.

Nothing here is a cluster manager: the shard list is static configuration, and
scheduling, discovery, restarts and load balancing over replicas belong to the platform.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import heapq
import logging
import sys
import time
from typing import Any, AsyncIterator, Optional, Sequence
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import connections
from ..errors import METHOD_NOT_ALLOWED_ROUTE, allowed_methods, method_not_allowed_message
from ..logs import logging_config
from ..middleware import AccessMiddleware, ApiKeyMiddleware, BodyLimitMiddleware
from ..schemas import (
    MAX_EXPLAIN_K,
    MAX_K,
    BatchSearchRequest,
    ErrorResponse,
    HealthResponse,
    SearchHit,
    SearchOptions,
    SearchRequest,
    QueryError,
    SearchResponse,
)
from .writers import WriterPool, add_write_routes
from ..settings import ROUTER_ENV_PREFIX, RouterSettings

__all__ = [
    "RouterSettings",
    "ShardFailure",
    "RoutedSearchResponse",
    "RoutedBatchResponse",
    "merge_hits",
    "fuse_hits",
    "build_router_app",
    "run_route",
]

logger = logging.getLogger(__name__)

# Request headers passed on to the shards: the API key, and a request id for tracing.
_FORWARDED_HEADERS = ("authorization", "x-request-id")


# ---------------------------------------------------------------------------------------
# Response models: the server's, plus what the router adds


class ShardFailure(BaseModel):
    shard: str = Field(description="base URL of the partition that did not answer")
    error: str = Field(description="timeout, unreachable, http_<status> or bad_response")
    message: str


class RoutedStats(BaseModel):
    """The partitions' stats combined: time is the slowest partition's (they run at once),
    counts are sums."""

    stage_ms: dict[str, float] = Field(description="per stage, the maximum over the partitions that answered")
    queue_ms: float
    batch_size: int
    hit_rate: float = Field(description="mean over the partitions that answered")
    bytes_read: int
    ios: int
    prefetched: int
    missed: int
    shards_answered: int
    shards_total: int
    route_ms: float = Field(description="milliseconds in the router, fan-out to merged answer")
    syntax: Optional[str] = Field(default=None, description="lexical and hybrid: how the query was read")
    ignored: Optional[list[str]] = Field(default=None, description="syntax simple: what was read as text instead "
                                                                   "(as each partition reads it alike)")


class RoutedSearchResponse(BaseModel):
    query: str
    results: list[SearchHit]
    stats: RoutedStats
    partial: bool = Field(description="true when a partition's results are missing")
    failed_shards: list[ShardFailure]


class RoutedSearchAnswer(RoutedSearchResponse):
    index: int = Field(description="the query's position in the request")


class RoutedBatchResponse(BaseModel):
    responses: list[RoutedSearchAnswer] = Field(description="the answered queries, in request order")
    errors: list[QueryError] = Field(default_factory=list, description="one per query the partitions could not "
                                                                       "search; the others are answered")
    partial: bool
    failed_shards: list[ShardFailure]


class ShardsBatch(BaseModel):
    """What a shard's /v1/search/batch answers (validated: a garbled answer is a failure)."""

    responses: list[SearchResponse]
    errors: list[QueryError] = []  # absent from shards that predate per-query errors

    def by_index(self) -> dict[int, SearchResponse]:
        """The answered queries by position (a shard without `index` answered every query, in order)."""
        return {i if r.index is None else r.index: r for i, r in enumerate(self.responses)}


# ---------------------------------------------------------------------------------------
# Merging


def merge_hits(per_shard: Sequence[Sequence[SearchHit]], k: int) -> list[SearchHit]:
    """Top-k of the union by score, descending; ties keep shard order, then rank order.

    Each input list is one partition's ranking (descending). Partitions hold disjoint
    documents, so no de-duplication is needed; if the same id came twice (a document
    indexed in two partitions by mistake) only its first, highest-scored copy is kept.
    """
    merged: list[SearchHit] = []
    seen: set[str] = set()
    streams = [[(-hit.score, shard, rank, hit) for rank, hit in enumerate(hits)] for shard, hits in enumerate(per_shard)]
    for _, _, _, hit in heapq.merge(*streams, key=lambda item: item[:3]):
        if hit.id in seen:
            continue
        seen.add(hit.id)
        merged.append(hit)
        if len(merged) == k:
            break
    return merged


def fuse_hits(per_shard: Sequence[Sequence[SearchHit]], k: int, hybrid: dict[str, Any]) -> list[SearchHit]:
    """The partitions' hybrid pools fused as one index fuses its own (see the module doc).

    per_shard: each partition's pool with `dense_score` and `lexical_score`; hybrid: the
    parameters the partitions report (`stats.hybrid`).
    """
    import numpy as np

    from espn.hybrid import HybridParams, fuse

    seen: dict[str, SearchHit] = {}
    for hits in per_shard:
        for hit in hits:
            seen.setdefault(hit.id, hit)
    hits = list(seen.values())
    nan = float("nan")
    dense = np.array([nan if h.dense_score is None else h.dense_score for h in hits], dtype=np.float32)
    lexical = np.array([nan if h.lexical_score is None else h.lexical_score for h in hits], dtype=np.float32)
    params = HybridParams.from_manifest(hybrid)
    rerank_count = int(hybrid.get("rerank_count", 100))

    def top(scores: np.ndarray, n: int) -> np.ndarray:
        present = np.flatnonzero(~np.isnan(scores))
        return present[np.argsort(-scores[present], kind="stable")[:n]]

    in_lexical = top(lexical, params.lexical_k)
    pool = np.union1d(top(dense, rerank_count), in_lexical)
    lexical_pool = np.full(len(hits), np.nan, dtype=np.float32)
    lexical_pool[in_lexical] = lexical[in_lexical]  # below the global lexical top: not on that list
    fused = fuse(pool, dense[pool], lexical_pool[pool], params)
    out = []
    for row, score, lexical_score in zip(fused.doc[:k].tolist(), fused.score[:k].tolist(), fused.lexical[:k].tolist()):
        out.append(hits[row].model_copy(update={
            "score": score, "lexical_score": None if lexical_score != lexical_score else lexical_score}))
    return out


def _fan_out_body(body: SearchOptions) -> dict[str, Any]:
    """What the partitions are asked: a hybrid search asks each for its whole pool."""
    out = body.model_dump(exclude_none=True)
    if body.mode == "hybrid":
        out["k"] = MAX_EXPLAIN_K if out.get("explain") else MAX_K
    return out


def _combine_stats(answered: Sequence[SearchResponse], total: int, route_ms: float) -> RoutedStats:
    stats = [response.stats for response in answered]
    stage_ms: dict[str, float] = {}
    for item in stats:
        for stage, ms in item.stage_ms.items():
            stage_ms[stage] = max(stage_ms.get(stage, 0.0), ms)
    return RoutedStats(
        stage_ms=stage_ms,
        queue_ms=max((s.queue_ms for s in stats), default=0.0),
        batch_size=max((s.batch_size for s in stats), default=0),
        hit_rate=sum(s.hit_rate for s in stats) / len(stats) if stats else 0.0,
        bytes_read=sum(s.bytes_read for s in stats),
        ios=sum(s.ios for s in stats),
        prefetched=sum(s.prefetched for s in stats),
        missed=sum(s.missed for s in stats),
        shards_answered=len(stats),
        shards_total=total,
        route_ms=round(route_ms, 3),
        syntax=next((s.syntax for s in stats if s.syntax), None),
        ignored=next((s.ignored for s in stats if s.ignored), None),
    )


def _merge_responses(query: str, answered: Sequence[SearchResponse], k: int, total: int,
                     failures: list[ShardFailure], route_ms: float) -> RoutedSearchResponse:
    pools = [response.results for response in answered]
    hybrid = next((r.stats.hybrid for r in answered if r.stats.mode == "hybrid" and r.stats.hybrid), None)
    return RoutedSearchResponse(
        query=query,
        results=merge_hits(pools, k) if hybrid is None else fuse_hits(pools, k, hybrid),
        stats=_combine_stats(answered, total, route_ms),
        partial=bool(failures),
        failed_shards=failures,
    )


# ---------------------------------------------------------------------------------------
# Fan-out


# Statuses that mean the request itself is wrong: every partition would say the same, so
# the caller gets it as is. Any other failure (404 from a misconfigured URL, 408, 429, 5xx)
# is the partition's problem and only makes the answer partial.
_CALLER_ERRORS = frozenset({400, 401, 403, 413, 415, 422})


class ClientError(Exception):
    """A shard refused the request itself (a status in _CALLER_ERRORS): passed on."""

    def __init__(self, status_code: int, body: Any) -> None:
        super().__init__(f"shard answered {status_code}")
        self.status_code, self.body = status_code, body


@dataclasses.dataclass
class _Fanout:
    client: httpx.AsyncClient
    shards: list[str]
    timeout_s: float
    metrics: "_RouterMetrics"

    async def call(self, shard: str, method: str, path: str, headers: dict[str, str],
                   json_body: Optional[dict[str, Any]]) -> httpx.Response | ShardFailure:
        try:
            # wait_for bounds the whole exchange (connect, queueing for a pooled connection,
            # response), which httpx's per-phase timeouts alone do not.
            response = await asyncio.wait_for(
                self.client.request(method, shard + path, json=json_body, headers=headers), self.timeout_s
            )
        except (asyncio.TimeoutError, httpx.TimeoutException):
            return self.record_failure(shard, "timeout", f"no answer within {self.timeout_s * 1000:.0f} ms")
        except httpx.TransportError as exc:
            return self.record_failure(shard, "unreachable", f"{type(exc).__name__}: {exc}")
        return response

    def record_failure(self, shard: str, error: str, message: str) -> ShardFailure:
        self.metrics.shard_failures.labels(shard=shard, error=error).inc()
        logger.warning("shard %s failed: %s (%s)", shard, error, message)
        return ShardFailure(shard=shard, error=error, message=message)

    async def search(self, path: str, body: dict[str, Any], headers: dict[str, str],
                     model: type[BaseModel]) -> tuple[list[Any], list[ShardFailure]]:
        """POST `body` to every shard at once; returns (parsed answers, failures)."""
        calls = [self.call(shard, "POST", path, headers, body) for shard in self.shards]
        answers: list[Any] = []
        failures: list[ShardFailure] = []
        client_errors: list[ClientError] = []
        for shard, outcome in zip(self.shards, await asyncio.gather(*calls)):
            if isinstance(outcome, ShardFailure):
                failures.append(outcome)
                continue
            status = outcome.status_code
            if status in _CALLER_ERRORS:
                client_errors.append(ClientError(status, _json_or_text(outcome)))
                continue
            if status != 200:
                failures.append(self.record_failure(shard, f"http_{status}", _message(outcome)))
                continue
            try:
                answers.append(model.model_validate_json(outcome.content))
            except ValidationError as exc:
                failures.append(self.record_failure(shard, "bad_response", f"unexpected body: {exc.error_count()} error(s)"))
        if client_errors:
            # Every partition validates the same request the same way: pass the first on.
            raise client_errors[0]
        return answers, failures


def _json_or_text(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return {"error": "shard_error", "message": response.text[:500]}


def _message(response: httpx.Response) -> str:
    body = _json_or_text(response)
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return response.reason_phrase or f"HTTP {response.status_code}"


# ---------------------------------------------------------------------------------------
# Metrics


class _RouterMetrics:
    """Per-app registry, so two routers (or a router and a server) in one process never
    collide on metric names."""

    def __init__(self) -> None:
        # Imported here: `espn serve` builds the CLI parser (and so imports this module)
        # before it sets up prometheus multiprocess mode for its workers.
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("espn_router_requests_total", "Requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("espn_router_request_seconds", "Time from request to merged answer",
                                 ["endpoint"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.partial = Counter("espn_router_partial_responses_total", "Answers with a partition missing",
                               ["endpoint"], registry=self.registry)
        self.shard_failures = Counter("espn_router_shard_failures_total", "Shard calls that failed, by reason",
                                      ["shard", "error"], registry=self.registry)


# ---------------------------------------------------------------------------------------
# The app


def _error(status_code: int, code: str, message: str, **extra: Any) -> JSONResponse:
    body = ErrorResponse(error=code, message=message, errors=None).model_dump(exclude_none=True)
    return JSONResponse({**body, **extra}, status_code=status_code)


def build_router_app(settings: RouterSettings, *, transport: Optional[httpx.AsyncBaseTransport] = None) -> FastAPI:
    """The router as a FastAPI app. `transport` replaces the network (tests)."""
    metrics = _RouterMetrics()
    timeout_s = settings.timeout_ms / 1000.0
    fanout: dict[str, _Fanout] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=settings.max_connections * len(settings.shards),
                              max_keepalive_connections=settings.max_connections * len(settings.shards))
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, transport=transport,
                                     trust_env=False) as client:
            fanout["client"] = _Fanout(client, list(settings.shards), timeout_s, metrics)
            logger.info("routing to %d shard(s): %s", len(settings.shards), ", ".join(settings.shards))
            if settings.writers:
                logger.info("writes to %d writer(s): %s", len(settings.writers), ", ".join(settings.writers))
            yield
            fanout.clear()

    app = FastAPI(
        title="ESPN router",
        summary="Fans queries out to the partitions of an index and merges their top-k",
        lifespan=lifespan,
    )

    def get_fanout() -> _Fanout:
        return fanout["client"]

    writer_pool = WriterPool(lambda: get_fanout().client, list(settings.writers), settings.write_timeout_ms / 1000.0,
                             lambda url, error, message: get_fanout().record_failure(url, error, message))

    def _observe(endpoint: str, started: float, partial: bool) -> None:
        _observe_status(endpoint, started, 200)
        if partial:
            metrics.partial.labels(endpoint=endpoint).inc()

    def _observe_status(endpoint: str, started: float, status: int) -> None:
        metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - started)
        metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        return _error(422, "invalid_request", "the request does not match the schema", errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own errors (404, 405) in the API's error body; a 405 names what the path takes."""
        if exc.status_code == 405:
            allowed = allowed_methods(request)
            response = _error(405, "method_not_allowed", method_not_allowed_message(request, allowed))
            response.headers["Allow"] = allowed
            return response
        response = _error(exc.status_code, "not_found" if exc.status_code == 404 else "error", str(exc.detail))
        response.headers.update(getattr(exc, "headers", None) or {})
        return response

    @app.exception_handler(ClientError)
    async def _passed_on(request: Request, exc: ClientError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status_code)

    def _headers(request: Request) -> dict[str, str]:
        return {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}

    def _unavailable(endpoint: str, failures: list[ShardFailure]) -> JSONResponse:
        metrics.requests.labels(endpoint=endpoint, status="503").inc()
        return _error(503, "no_shard_answered", f"none of the {len(settings.shards)} shard(s) answered",
                      failed_shards=[f.model_dump() for f in failures])

    @app.post("/v1/search", response_model=RoutedSearchResponse, summary="Search one query over every partition",
              responses={422: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
    async def search(body: SearchRequest, request: Request) -> Any:
        started = time.perf_counter()
        answers, failures = await get_fanout().search(
            "/v1/search", _fan_out_body(body), _headers(request), SearchResponse)
        if not answers:
            return _unavailable("search", failures)
        merged = _merge_responses(body.query, answers, body.k, len(settings.shards), failures,
                                  (time.perf_counter() - started) * 1000)
        _observe("search", started, merged.partial)
        return merged

    @app.post("/v1/search/batch", response_model=RoutedBatchResponse,
              summary="Search several queries over every partition",
              responses={422: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
    async def search_batch(body: BatchSearchRequest, request: Request) -> Any:
        started = time.perf_counter()
        answers, failures = await get_fanout().search(
            "/v1/search/batch", _fan_out_body(body), _headers(request), ShardsBatch)
        if not answers:
            return _unavailable("batch", failures)
        if any(len(answer.responses) + len(answer.errors) != len(body.queries) for answer in answers):
            return _error(502, "bad_gateway", "a shard answered a different number of queries than asked")
        route_ms = (time.perf_counter() - started) * 1000
        by_index = [answer.by_index() for answer in answers]
        # Every partition checks a query's text alike: one that no partition answered is an
        # error entry, in the first partition's words.
        refused = {e.index: e for answer in reversed(answers) for e in answer.errors}
        responses, errors = [], []
        for i, query in enumerate(body.queries):
            answered = [shard[i] for shard in by_index if i in shard]
            if not answered:
                errors.append(refused.get(i) or QueryError(index=i, error="invalid_query",
                                                           message=f"queries[{i}]: no partition answered it"))
                continue
            merged = _merge_responses(query, answered, body.k, len(settings.shards), failures, route_ms)
            responses.append(RoutedSearchAnswer(index=i, **dict(merged)))
        _observe("batch", started, bool(failures))
        return RoutedBatchResponse(responses=responses, errors=errors, partial=bool(failures), failed_shards=failures)

    _add_middleware(app, settings)
    if settings.writers:
        add_write_routes(app, lambda: writer_pool, _observe_status)
    else:
        @app.api_route("/v1/documents/{doc_id:path}", methods=["PUT", "DELETE", "POST"], include_in_schema=False,
                       name=METHOD_NOT_ALLOWED_ROUTE)
        async def no_writes(request: Request) -> JSONResponse:
            allowed = allowed_methods(request)
            response = _error(405, "method_not_allowed", f"this router takes no writes: start it with --writers "
                          f"(one writer URL per partition); {request.url.path} takes {allowed}")
            response.headers["Allow"] = allowed
            return response

    @app.get("/v1/documents/{doc_id:path}", summary="A document, from the partition that owns its id",
             responses={404: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
    async def document(doc_id: str, request: Request) -> Any:
        fan = get_fanout()
        path = "/v1/documents/" + quote(doc_id, safe="")
        # With writers the layout is the hash rule: only the owner can hold the id. Without
        # (an index built before the rule), every partition is asked.
        shards = [fan.shards[writer_pool.owner(doc_id)]] if settings.writers else fan.shards
        outcomes = await asyncio.gather(*(fan.call(s, "GET", path, _headers(request), None) for s in shards))
        failures = []
        for shard, outcome in zip(shards, outcomes):
            if isinstance(outcome, ShardFailure):
                failures.append(outcome)
            elif outcome.status_code == 200:
                return JSONResponse(_json_or_text(outcome))
            elif outcome.status_code in (401, 403):
                return JSONResponse(_json_or_text(outcome), status_code=outcome.status_code)
            elif outcome.status_code != 404:
                failures.append(fan.record_failure(shard, f"http_{outcome.status_code}", _message(outcome)))
        if failures:  # it may live in a partition that did not answer
            return _error(503, "unavailable", f"document {doc_id!r} not found in the partitions that answered",
                          failed_shards=[f.model_dump() for f in failures])
        return _error(404, "not_found", f"no document with id {doc_id!r}")

    # exclude={"reader"}: a router has no reader of its own (HealthResponse is shared with the server).
    @app.get("/healthz", response_model=HealthResponse, response_model_exclude={"reader"},
             summary="Liveness: the router answers")
    async def healthz() -> HealthResponse:
        return HealthResponse(status="ok")

    @app.get("/readyz", response_model=HealthResponse,
             summary="Readiness: at least one partition is ready",
             responses={503: {"model": HealthResponse}})
    async def readyz() -> Response:
        fan = get_fanout()
        outcomes = await asyncio.gather(*(fan.call(s, "GET", "/readyz", {}, None) for s in fan.shards))
        ready = [s for s, o in zip(fan.shards, outcomes) if isinstance(o, httpx.Response) and o.status_code == 200]
        detail = f"{len(ready)} of {len(fan.shards)} shard(s) ready"
        if ready:
            return JSONResponse(HealthResponse(status="ready", detail=detail).model_dump(exclude={"reader"}))
        return JSONResponse(HealthResponse(status="unavailable", detail=detail).model_dump(exclude={"reader"}),
                            status_code=503,
                            headers={"Retry-After": "1"})

    @app.get("/metrics", summary="Prometheus metrics of the router", response_class=Response)
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _add_middleware(app: FastAPI, settings: RouterSettings) -> None:
    """As the server's: the key checked before the body is read (a request without it gets 401,
    never a schema error), the body bounded in size and time, one access line per request that
    names the path but never the query string (where a client may have put its key)."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key.get_secret_value())
    app.add_middleware(AccessMiddleware, metrics=None, routes=app.router.routes)


# ---------------------------------------------------------------------------------------
# Command line: `espn route`


def run_route(args: argparse.Namespace) -> int:
    """Validate the settings and serve until SIGTERM/SIGINT. Returns an exit code."""
    import uvicorn

    from ..cli import is_loopback, settings_error_line

    given = {name: getattr(args, name, None) for name in RouterSettings.model_fields}
    try:
        settings = RouterSettings(**{name: value for name, value in given.items() if value is not None})
    except ValidationError as error:
        print(settings_error_line("route", ROUTER_ENV_PREFIX, error), file=sys.stderr)
        return 2
    print(f"espn route: {len(settings.shards)} shard(s), timeout {settings.timeout_ms:g} ms, "
          f"listening on {settings.host}:{settings.port}", file=sys.stderr)
    if settings.api_key is None and not is_loopback(settings.host):
        print(f"espn route: warning: listening on {settings.host} without ESPN_API_KEY: anyone who can reach it can "
              "search every partition", file=sys.stderr)
    limits = settings.connection_limits()
    connections.install(limits)
    uvicorn.run(build_router_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                log_config=logging_config(settings.log_level), access_log=False, server_header=False,
                http=connections.GuardedH11Protocol, backlog=limits.backlog, timeout_keep_alive=settings.keep_alive_s,
                timeout_graceful_shutdown=30)
    return 0
