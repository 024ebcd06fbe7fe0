"""The FastAPI app: `build_app(settings)` builds it; its lifespan opens the index.

uvicorn starts every worker with `espn_server.app:create_app` as a factory (`--factory`):
the settings come from the `ESPN_*` environment that `espn serve` set up, so all
workers build the same app. Nothing happens at import time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.metadata
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping, Sequence

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from espn.live.replication.follower import Follower
from espn.live.replication.publisher import Publisher
from espn.live.status import read_only_reason

from . import connections
from .batching import MicroBatcher
from .deps import AppState, declare_api_key
from .docs import add_offline_docs
from .errors import register_exception_handlers
from .metrics import ServerMetrics
from .middleware import AccessMiddleware, ApiKeyMiddleware, BodyLimitMiddleware, CancelledRequestMiddleware
from .openapi import add_contract
from .page import add_search_page
from .routes import documents, health, search, snapshots
from .schemas import ErrorResponse
from .settings import ServerSettings

if TYPE_CHECKING:
    from espn import Searcher
    from espn.results import QueryResult

__all__ = ["build_app", "create_app"]

logger = logging.getLogger(__name__)


def _version() -> str:
    try:
        return importlib.metadata.version("espn")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _open_searcher(settings: ServerSettings) -> "Searcher":
    import torch  # the library imports it anyway; here only to size its thread pool

    from espn import Searcher

    # N workers x all cores each would oversubscribe the CPU; give each its share.
    torch.set_num_threads(settings.effective_torch_threads)
    return Searcher.open(settings.index, reader=settings.reader, device=settings.device,
                         reader_options=settings.reader_open_options())


def _read_only(settings: ServerSettings) -> bool:
    """Without `espn serve` (which decides it once): read-only when the index cannot be written."""
    reason = read_only_reason(settings.index)
    if reason is not None:
        logger.warning("serving read-only: %s; writes get 409", reason)
    return reason is not None


def _batch_search_many(state: AppState, metrics: ServerMetrics):  # noqa: ANN202 (closure)
    """Concurrent requests of several parameter sets: every query tokenised and encoded in one
    batch, then each group searched with its own parameters (a failure stays in its group).
    The newest generation's Searcher is leased for the call: a write that swaps in a newer
    one meanwhile closes this one only when the call is done."""

    def search_many(groups: list[tuple[list[str], Mapping[str, Any]]]) -> list[Any]:
        with state.require_live().lease() as searcher:
            return _search_groups(searcher, groups)

    def _search_groups(searcher: "Searcher", groups: list[tuple[list[str], Mapping[str, Any]]]) -> list[Any]:
        started = time.perf_counter()
        texts: list[list[str] | None] = [None] * len(groups)  # what each group encodes (None: nothing)
        embeddings = None
        if len(groups) > 1:
            try:
                texts = [searcher.dense_queries(queries, params.get("mode"), params.get("syntax")) for queries, params in groups]
                flat = [text for group in texts if group is not None for text in group]
                embeddings = searcher.encode(flat) if flat else None
            except Exception:  # noqa: BLE001 - a bad group fails below, on its own
                texts, embeddings = [None] * len(groups), None
        encode_ms = (time.perf_counter() - started) * 1000
        outcomes: list[Any] = []
        start = 0
        for (queries, params), group_texts in zip(groups, texts):
            rows = None
            if embeddings is not None and group_texts is not None:
                rows = slice(start, start + len(group_texts))
                start += len(group_texts)
            try:
                results = searcher.search(queries, embeddings=None if rows is None or embeddings is None else
                                          embeddings[rows], **params)
            except ValueError as exc:  # InvalidParameterError: one query's refusal is only that query's
                outcomes.append(_one_by_one(searcher, queries, params) if len(queries) > 1 else exc)
                continue
            except Exception as exc:  # noqa: BLE001 - handed to this group's waiters
                outcomes.append(exc)
                continue
            if results and rows is not None:  # the shared encode, in this call's stage times
                stage_ms = results[0].stats.stage_ms
                stage_ms["encode"] = round(encode_ms, 3)
                stage_ms["total"] = round(stage_ms["total"] + encode_ms, 3)
            if results:
                metrics.observe_batch(len(queries), results[0].stats.stage_ms)
                metrics.observe_waves(results[0].stats.waves, results[0].stats.waves_skipped)
                metrics.set_record_cache(searcher.reader.describe().get("record_cache"))
            outcomes.append(results)
        return outcomes

    return search_many


def _one_by_one(searcher: "Searcher", queries: list[str], params: Mapping[str, Any]) -> list[Any]:
    """Each query of a refused group searched alone: its result, or the exception for its own waiter."""
    out: list[Any] = []
    for query in queries:
        try:
            out += searcher.search([query], **params)
        except ValueError as exc:
            out.append(exc)
    return out


def _mean_text_bytes(searcher: "Searcher") -> float:
    """Mean stored bytes per passage (title and text as JSON), for the response-size budget."""
    size = searcher.index.file("docs.jsonl").stat().st_size
    return size / max(1, searcher.num_documents)


def _warmup(state: AppState) -> None:
    with state.require_live().lease() as searcher:
        searcher.warmup()


async def _warm(state: AppState) -> None:
    if state.settings.warmup:
        state.status = "warming"
        await asyncio.to_thread(_warmup, state)
    state.status, state.ready = "ready", True
    state.metrics.ready.set(1)
    searcher = state.require_live().current
    logger.info("ready", extra={"index": str(state.settings.index), "documents": searcher.num_documents,
                                "generation": searcher.generation, "read_only": state.read_only})


def _log_warm_failure(task: "asyncio.Task[None]") -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("warm-up failed; /readyz stays 503", exc_info=task.exception())


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the index (failing start-up if it cannot), warm it in the background, drain at exit."""
    state: AppState = app.state.espn
    settings = state.settings
    state.metrics.ready.set(0)
    searcher = await asyncio.to_thread(_open_searcher, settings)
    from espn.lease import LiveSearcher

    state.read_only = settings.read_only if settings.read_only is not None else _read_only(settings)
    executor = concurrent.futures.ThreadPoolExecutor(settings.search_threads, thread_name_prefix="espn-search")
    batcher: MicroBatcher[QueryResult] = MicroBatcher(
        None,
        executor,
        max_batch_size=settings.max_batch_size,
        max_wait_s=settings.batch_wait_ms / 1000.0,
        max_concurrent=settings.search_threads,
        max_pending=settings.max_pending,
        fair_chunk=settings.fair_chunk_queries,
        on_batch=lambda size, seconds: state.metrics.queued.set(batcher.pending),
        search_many=_batch_search_many(state, state.metrics),
    )
    batcher.start()
    state.live, state.batcher = LiveSearcher(searcher), batcher
    state.text_bytes = _mean_text_bytes(searcher)
    reader = searcher.reader.describe()
    state.metrics.set_reader(str(reader.get("reader", searcher.reader_name)), str(reader.get("engine", "")))
    if settings.follow is not None:
        state.follower = Follower(settings.follow, settings.index, settings.follow_interval_s).start()
    if settings.publish is not None:
        state.publisher = Publisher(settings.publish, settings.index, settings.publish_interval_s,
                                    settings.publish_keep).start()
    warm = asyncio.create_task(_warm(state), name="espn-warmup")
    warm.add_done_callback(_log_warm_failure)
    try:
        yield
    finally:
        # uvicorn has already let in-flight requests finish (--graceful-timeout) by now.
        state.ready, state.status = False, "draining"
        state.metrics.ready.set(0)
        await asyncio.wait([warm])
        if state.follower is not None:
            await asyncio.to_thread(state.follower.stop)
        await batcher.close()
        executor.shutdown(wait=True)
        if state.writes is not None:  # what was accepted is published before the index closes
            await asyncio.to_thread(state.writes.close)
        if state.publisher is not None:  # ... and uploaded, when the store answers
            await asyncio.to_thread(state.publisher.stop)
        state.require_live().close()
        state.metrics.close()
        logger.info("index closed")


def build_app(settings: ServerSettings) -> FastAPI:
    """The app for one worker. The index opens in the lifespan, not here."""
    app = FastAPI(
        title="ESPN search",
        version=_version(),
        summary="Multi-vector retrieval with the embedding table on SSD",
        lifespan=lifespan,
        docs_url=None,  # add_offline_docs serves it without a CDN
        redoc_url=None,
    )
    add_offline_docs(app)
    add_search_page(app)
    metrics = ServerMetrics()
    app.state.espn = AppState(settings=settings, metrics=metrics)

    register_exception_handlers(app)
    # With a key, the bearer scheme and its 401 are part of every /v1 operation's contract;
    # without one they are not (ApiKeyMiddleware does the checking).
    keyed = settings.api_key is not None
    protected = [Depends(declare_api_key)] if keyed else []
    unauthorized: dict[int | str, dict[str, Any]] = {
        401: {"model": ErrorResponse, "description": "missing or wrong API key"}} if keyed else {}
    app.include_router(search.router, dependencies=protected, responses=unauthorized)
    app.include_router(documents.router, dependencies=protected, responses=unauthorized)
    app.include_router(snapshots.router, dependencies=protected, responses=unauthorized)
    app.include_router(health.router)
    if settings.metrics_port is None:  # else the parent process serves it on its own port
        app.include_router(health.metrics_router)

    add_contract(app)

    # Added innermost first: the access log sees every response, 413s and CORS included; the
    # key is checked before the body is read; a CORS preflight is answered without the key.
    app.add_middleware(CancelledRequestMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key.get_secret_value())
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "PUT", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
        )
    # The API routes themselves (not the included-router wrappers) give the endpoint labels.
    api_routes = [*search.router.routes, *documents.router.routes, *health.router.routes,
                  *health.metrics_router.routes]
    app.add_middleware(AccessMiddleware, metrics=metrics, routes=api_routes)
    return app


def create_app() -> FastAPI:
    """uvicorn factory (`server.app:create_app --factory`): settings from ESPN_* variables."""
    settings = ServerSettings()  # type: ignore[call-arg]  # index comes from ESPN_INDEX
    connections.install(settings.connection_limits())  # this worker's connections (uvicorn's http=)
    return build_app(settings)
