"""The FastAPI app: `build_app(settings)` builds it over the engines of its indexes; its lifespan opens them.

uvicorn starts every worker with `espn_server.app:create_app` as a factory (`--factory`):
the settings come from the `ESPN_*` environment that `espn serve` set up, so all
workers build the same app. Nothing happens at import time.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
from typing import Any, AsyncIterator

from fastapi import Depends, FastAPI, Path
from fastapi.middleware.cors import CORSMiddleware

from espn.engine import open_engines

from . import connections
from .deps import INDEX_PARAMETER, AppState, declare_api_key
from .docs import add_offline_docs
from .errors import flat_routes, register_exception_handlers
from .metrics import ServerMetrics
from .middleware import AccessMiddleware, AuthMiddleware, BodyLimitMiddleware, CancelledRequestMiddleware
from .openapi import add_contract
from .page import add_search_page
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


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Open the default index (failing start-up if it cannot; it warms in the background), and
    at exit close every index: queued searches answered, accepted writes published."""
    state: AppState = app.state.espn
    await state.engines.start()
    try:
        yield
    finally:
        # uvicorn has already let in-flight requests finish (--graceful-timeout) by now.
        await state.engines.close()
        state.metrics.close()
        logger.info("index closed")


async def _index_named(index: str = Path(description="the index's name (GET /v1/indexes lists them)")) -> None:
    """Declares the index's name in the OpenAPI document; deps.get_engine reads it from the path."""


def build_app(settings: ServerSettings) -> FastAPI:
    """The app for one worker. The indexes open in the lifespan, not here."""
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
    state = app.state.espn = AppState(settings=settings, metrics=metrics,
                                      engines=open_engines(settings.serve_config(), metrics))

    register_exception_handlers(app)
    # With a key, the bearer scheme and its 401 are part of every /v1 operation's contract;
    # without one they are not (AuthMiddleware does the checking).
    keyed = settings.keyed
    protected = [Depends(declare_api_key)] if keyed else []
    unauthorized: dict[int | str, dict[str, Any]] = {
        401: {"model": ErrorResponse, "description": "missing or wrong API key"}} if keyed else {}
    not_found: dict[int | str, dict[str, Any]] = {404: {"model": ErrorResponse, "description": "no index with this name"}}
    for router in (search.router, documents.router, snapshots.router):
        # The default index's routes, and each named index's, with its name as a path parameter.
        app.include_router(router, prefix="/v1", dependencies=protected, responses=unauthorized)
        app.include_router(router, prefix=f"/v1/indexes/{{{INDEX_PARAMETER}}}", tags=["indexes"],
                           dependencies=[*protected, Depends(_index_named)], responses={**unauthorized, **not_found})
    app.include_router(indexes.router, dependencies=protected, responses=unauthorized)
    app.include_router(health.router)
    if settings.metrics_port is None:  # else the parent process serves it on its own port
        app.include_router(health.metrics_router)

    add_contract(app)

    # Added innermost first: the access log sees every response, 413s and CORS included; the
    # key is checked before the body is read; a CORS preflight is answered without the key; a
    # valid single search skips FastAPI's request handling (SearchFastPath), nothing else.
    app.add_middleware(SearchFastPath, engines=state.engines)
    app.add_middleware(CancelledRequestMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    if settings.keyed:
        app.add_middleware(AuthMiddleware, keyring=settings.keyring(), default_index=state.engines.default_name)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST", "PUT", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
        )
    # The routes themselves (not the included-router wrappers) give the endpoint labels.
    app.add_middleware(AccessMiddleware, metrics=metrics, routes=flat_routes(app))
    return app


def create_app() -> FastAPI:
    """uvicorn factory (`server.app:create_app --factory`): settings from ESPN_* variables."""
    settings = ServerSettings()  # type: ignore[call-arg]  # index comes from ESPN_INDEX
    connections.install(settings.connection_limits())  # this worker's connections (uvicorn's http=)
    return build_app(settings)
