"""What the router's routes depend on: its per-app state (settings, metrics, the shards'
client and the writers, opened by the lifespan), the headers passed on, its error body."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from ..errors import ApiError
from ..schemas import ErrorResponse
from ..router_settings import RouterSettings
from .fanout import Fanout, RouterMetrics
from .models import ShardFailure
from .routing import MapRouting, StaticRouting
from .writers import WriterPool

__all__ = ["RouterState", "get_router_state", "forwarded_headers", "router_error"]

# Request headers passed on to the shards: the API key, and a request id for tracing.
_FORWARDED_HEADERS = ("authorization", "x-request-id")


def router_error(status_code: int, code: str, message: str, **extra: Any) -> JSONResponse:
    """The API's error body, with what the router adds (failed_shards, ...)."""
    body = ErrorResponse(error=code, message=message, errors=None).model_dump(exclude_none=True)
    return JSONResponse({**body, **extra}, status_code=status_code)


@dataclasses.dataclass
class RouterState:
    """Everything one router app owns; created by build_router_app, opened by its lifespan."""

    settings: RouterSettings
    metrics: RouterMetrics
    routing: StaticRouting | MapRouting  # the partitions, their replicas and writers (flags or a shard map)
    fanout: Optional[Fanout] = None  # the shards and their client, while the app runs
    writers: Optional[WriterPool] = None  # with --writers: one writer per partition

    def require_fanout(self) -> Fanout:
        if self.fanout is None:
            raise ApiError(503, "the router is not started", code="unavailable", headers={"Retry-After": "1"})
        return self.fanout

    def require_writers(self) -> WriterPool:
        if self.writers is None:
            raise ApiError(503, "the router is not started", code="unavailable", headers={"Retry-After": "1"})
        return self.writers

    def observe(self, endpoint: str, started: float, status: int = 200, partial: bool = False) -> None:
        """One request's latency and status (and, when partial, that a partition was missing)."""
        self.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - started)
        self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if partial:
            self.metrics.partial.labels(endpoint=endpoint).inc()

    def unavailable(self, endpoint: str, failures: list[ShardFailure]) -> JSONResponse:
        """No partition answered: a 503 naming each failure."""
        self.metrics.requests.labels(endpoint=endpoint, status="503").inc()
        return router_error(503, "no_shard_answered", f"none of the {len(failures)} shard(s) answered",
                            failed_shards=[f.model_dump() for f in failures])


async def get_router_state(request: Request) -> RouterState:
    """A coroutine: a plain `def` dependency would cost a thread-pool hop per request (server.deps)."""
    return request.app.state.router


def forwarded_headers(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
