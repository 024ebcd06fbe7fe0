"""What routes depend on: the app's engines, the index a request names, and the API key's
declaration in the OpenAPI document."""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Optional

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from espn.engine import Engine, Engines

from .auth import FULL_ACCESS, Principal
from .metrics import ServerMetrics
from .middleware import PRINCIPAL_KEY
from .settings import ServerSettings

__all__ = ["AppState", "get_state", "get_engine", "get_principal", "declare_api_key", "INDEX_PARAMETER"]

#: The path parameter that names an index (/v1/indexes/{index}/...); the routes without it serve the default.
INDEX_PARAMETER = "index"


@dataclasses.dataclass
class AppState:
    """What one app instance holds: its settings, its metrics and the engines of its indexes."""

    settings: ServerSettings
    metrics: ServerMetrics
    engines: Engines


# The dependencies are coroutines: FastAPI runs a plain `def` dependency in its thread pool, a
# thread hop per request (measured: 0.4 ms of a search's 3.9 ms of HTTP overhead) for what is
# an attribute read.
async def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.espn
    return state


async def get_engine(request: Request) -> AsyncIterator[Engine]:
    """The index the request names (/v1/indexes/{index}/...; else the default), held for the
    request: opened first if it is closed, and not closed or deleted while the request is inside."""
    name: Optional[str] = request.path_params.get(INDEX_PARAMETER)
    async with request.app.state.espn.engines.use(name) as engine:
        yield engine


async def get_principal(request: Request) -> Optional[Principal]:
    """Who the request comes from (server.auth): the key's principal, None for a request without a
    valid key, full access on a server that needs no key."""
    if not request.app.state.espn.settings.keyed:
        return FULL_ACCESS
    principal: Optional[Principal] = getattr(request.state, PRINCIPAL_KEY, None)
    return principal


_bearer = HTTPBearer(auto_error=False, description="the value of ESPN_API_KEY")


async def declare_api_key(credentials: Optional[HTTPAuthorizationCredentials] = Depends(_bearer)) -> None:
    """Declares the bearer scheme in the OpenAPI document (added to /v1/* only when a key is set).

    The key itself is checked by AuthMiddleware, before the body is read.
    """
