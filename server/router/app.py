"""The router app: `build_router_app(settings)` assembles it from `routes/` as `build_app`
assembles the server; its lifespan opens the shards' client (and the writers)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import ApiError, allowed_methods, method_not_allowed_message
from ..middleware import AccessMiddleware, AuthMiddleware, BodyLimitMiddleware
from ..router_settings import RouterSettings
from .deps import RouterState, router_error
from .fanout import ClientError, Fanout, RouterMetrics
from .index_path import RouterIndexRoutes
from .routes import documents, health, search, writes
from .routing import MapRouting, routing_for
from .writers import WriterPool

__all__ = ["build_router_app"]

logger = logging.getLogger(__name__)


def _lifespan(state: RouterState, transport: Optional[httpx.AsyncBaseTransport]):  # noqa: ANN202 (a factory)
    settings = state.settings
    timeout_s = settings.timeout_ms / 1000.0

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        routing = state.routing
        watching: asyncio.Task[None] | None = None
        if isinstance(routing, MapRouting):
            await routing.start()  # no map, no router: a clear error at start, not 503s
            watching = asyncio.create_task(routing.run(), name="espn-shard-map")
        connections = settings.max_connections * max(1, len(settings.shards) or routing.partition_count())
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, transport=transport,
                                     trust_env=False) as client:
            fanout = Fanout(client, lambda: routing.targets, timeout_s, state.metrics)
            state.fanout = fanout
            state.writers = WriterPool(client, routing, settings.write_timeout_ms / 1000.0, fanout.record_failure)
            logger.info("routing to %d partition(s): %s", len(fanout.shards), ", ".join(fanout.shards))
            if settings.shard_map is not None:
                logger.info("partitions, replicas and writers from the shard map at %s", settings.shard_map)
            elif settings.writers:
                logger.info("writes to %d writer(s): %s", len(settings.writers), ", ".join(settings.writers))
            try:
                yield
            finally:
                if watching is not None:
                    watching.cancel()
                state.fanout = state.writers = None

    return lifespan


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
    return router_error(422, "invalid_request", "the request does not match the schema", errors=errors)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (404, 405) in the API's error body; a 405 names what the path takes."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 405:
        allowed = allowed_methods(request)
        response = router_error(405, "method_not_allowed", method_not_allowed_message(request, allowed))
        response.headers["Allow"] = allowed
        return response
    response = router_error(exc.status_code, "not_found" if exc.status_code == 404 else "error", str(exc.detail))
    response.headers.update(getattr(exc, "headers", None) or {})
    return response


async def _passed_on(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ClientError)
    return JSONResponse(exc.body, status_code=exc.status_code)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    response = router_error(exc.status_code, exc.code, exc.message)
    response.headers.update(exc.headers or {})
    return response


def _add_middleware(app: FastAPI, settings: RouterSettings) -> None:
    """As the server's: the key checked before the body is read (a request without it gets 401,
    never a schema error), the body bounded in size and time, one access line per request that
    names the path but never the query string (where a client may have put its key)."""
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    if settings.keyed:  # the partitions check the key again: the router passes it on
        app.add_middleware(AuthMiddleware, keyring=settings.keyring(), default_index=None)
    app.add_middleware(RouterIndexRoutes)  # inside the key check: /v1/indexes/{name}/... needs the key too
    app.add_middleware(AccessMiddleware, metrics=None, routes=app.router.routes)


def build_router_app(settings: RouterSettings, *, transport: Optional[httpx.AsyncBaseTransport] = None) -> FastAPI:
    """The router as a FastAPI app. `transport` replaces the network (tests)."""
    state = RouterState(settings=settings, metrics=RouterMetrics(), routing=routing_for(settings))
    app = FastAPI(
        title="ESPN router",
        summary="Fans queries out to the partitions of an index and merges their top-k",
        lifespan=_lifespan(state, transport),
    )
    app.state.router = state
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientError, _passed_on)
    app.add_exception_handler(ApiError, _api_error)
    app.include_router(search.router)
    _add_middleware(app, settings)
    app.include_router(writes.router if state.routing.takes_writes else writes.no_writes_router)
    app.include_router(documents.router)
    app.include_router(health.router)
    return app
