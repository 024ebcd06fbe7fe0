"""The FastAPI app: `build_app(settings)` builds it; its lifespan opens the index.

uvicorn starts every worker with `espn_server.app:create_app` as a factory (`--factory`):
the settings come from the `ESPN_*` environment that `espn serve` set up, so all
workers build the same app. Nothing happens at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import socket
import time
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware

from espn.errors import EspnError
from espn.service import FencedWriter, Follower, remove_snapshot_leftovers

from . import connections
from .deps import AppState, declare_api_key, get_writes
from .docs import add_offline_docs
from .errors import register_exception_handlers
from .metrics import ServerMetrics
from .middleware import AccessMiddleware, ApiKeyMiddleware, BodyLimitMiddleware, CancelledRequestMiddleware
from .openapi import add_contract
from .page import add_search_page
from .indexes import IndexRegistry, IndexRoutes, close_index, open_index
from .routes import documents, health, indexes, search, snapshots
from .schemas import ErrorResponse
from .search_fast_path import SearchFastPath
from .settings import ServerSettings

__all__ = ["build_app", "create_app"]

logger = logging.getLogger(__name__)


def _version() -> str:
    try:
        return importlib.metadata.version("espn")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


async def _warm(state: AppState) -> None:
    if state.settings.warmup:
        state.status = "warming"
        await asyncio.to_thread(state.require_search().warmup)
        if state.settings.follow is None and not state.read_only:
            await asyncio.to_thread(_warm_writes, state)
    state.status, state.ready = "ready", True
    state.metrics.ready.set(1)
    searcher = state.require_live().current
    logger.info("ready", extra={"index": str(state.settings.index), "documents": searcher.num_documents,
                                "generation": searcher.generation, "read_only": state.read_only})


def _warm_writes(state: AppState) -> None:
    """The write path's encoder, loaded before /readyz says ready: loaded at the first write
    instead, it cost that write 4 s on an idle 2-core machine and over 10 s on a busy one. A
    failure here is the first write's to report (as a 4xx/5xx with its message); searches go on."""
    started = time.perf_counter()
    try:
        get_writes(state).warmup()
        logger.info("write path warmed", extra={"seconds": round(time.perf_counter() - started, 3)})
    except EspnError as exc:  # the index's own answer to a write (e.g. one of precomputed embeddings: no text)
        logger.info("write path not warmed: %s", exc)
    except Exception:
        logger.warning("the write path could not be warmed; the first write will load it", exc_info=True)


def _log_warm_failure(task: "asyncio.Task[None]") -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("warm-up failed; /readyz stays 503", exc_info=task.exception())


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the index (failing start-up if it cannot), warm it in the background, drain at exit."""
    state: AppState = app.state.espn
    settings = state.settings
    registry = state.indexes
    assert registry is not None  # build_app made it
    state.metrics.ready.set(0)
    await open_index(state, registry.encoders)
    searcher = state.require_live().current
    reader = searcher.reader.describe()
    state.metrics.set_reader(str(reader.get("reader", searcher.reader_name)), str(reader.get("engine", "")))
    state.metrics.set_prefetch(searcher.prefetch_estimates)  # the verdict before the first search
    if settings.snapshot_dir is not None:  # what snapshots killed with an earlier server left
        removed = await asyncio.to_thread(remove_snapshot_leftovers, settings.snapshot_dir)
        if removed:
            logger.info("removed leftovers of killed snapshots", extra={"removed": removed})
    if settings.follow is not None:
        state.follower = Follower(settings.follow, settings.index, settings.follow_interval_s,
                                  advertise_url=settings.advertise_url or "").start()
    if settings.publish is not None:
        state.publisher = FencedWriter(settings.publish, settings.index, settings.publish_interval_s,
                                       settings.publish_keep, name=settings.writer_name or socket.gethostname(),
                                       advertise_url=settings.advertise_url or "", lease_s=settings.writer_lease_s,
                                       wait_s=settings.write_wait_s, shard_map=settings.shard_map).start()
    warm = asyncio.create_task(_warm(state), name="espn-warmup")
    warm.add_done_callback(_log_warm_failure)
    registry.start(settings.index_idle_close_s)
    try:
        yield
    finally:
        # uvicorn has already let in-flight requests finish (--graceful-timeout) by now.
        state.ready, state.status = False, "draining"
        state.metrics.ready.set(0)
        await asyncio.wait([warm])
        if state.follower is not None:
            await asyncio.to_thread(state.follower.stop)
        await registry.close()  # the other indexes: each publishes what it accepted
        # Searches what is queued, publishes what was accepted (and uploads it), closes the index.
        await close_index(state, registry.encoders)
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
    state = app.state.espn = AppState(settings=settings, metrics=metrics)
    registry = state.indexes = IndexRegistry(state, settings, metrics)

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
    app.include_router(indexes.router, dependencies=protected, responses=unauthorized)
    app.include_router(health.router)
    if settings.metrics_port is None:  # else the parent process serves it on its own port
        app.include_router(health.metrics_router)

    add_contract(app)

    # Added innermost first: the access log sees every response, 413s and CORS included; the
    # key is checked before the body is read; a CORS preflight is answered without the key; a
    # valid single search skips FastAPI's request handling (SearchFastPath), nothing else.
    app.add_middleware(SearchFastPath, state=app.state.espn, handlers=app.exception_handlers)
    app.add_middleware(IndexRoutes, registry=registry)  # /v1/indexes/{name}/search -> /v1/search of that index
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
    api_routes = [*search.router.routes, *documents.router.routes, *indexes.router.routes, *health.router.routes,
                  *health.metrics_router.routes]
    app.add_middleware(AccessMiddleware, metrics=metrics, routes=api_routes)
    return app


def create_app() -> FastAPI:
    """uvicorn factory (`server.app:create_app --factory`): settings from ESPN_* variables."""
    settings = ServerSettings()  # type: ignore[call-arg]  # index comes from ESPN_INDEX
    connections.install(settings.connection_limits())  # this worker's connections (uvicorn's http=)
    return build_app(settings)
