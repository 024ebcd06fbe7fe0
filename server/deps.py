"""What routes depend on: the per-app state, and the API key's declaration in the OpenAPI document."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING, Any, Optional

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from espn.service import FencedWriter, Follower

from .errors import ApiError, ServiceUnavailableError
from .metrics import ServerMetrics
from .search_service import SearchService
from .settings import ServerSettings
from .writes import WriteService

if TYPE_CHECKING:  # the library pulls in torch and faiss; routes only need the types
    from espn.service import LiveSearcher

    from .indexes import IndexRegistry


__all__ = ["AppState", "INDEX_STATE_KEY", "state_of", "get_state", "get_search", "get_writes", "declare_api_key"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class AppState:
    """Everything one app instance owns; created by build_app, filled by its lifespan."""

    settings: ServerSettings
    metrics: ServerMetrics
    live: Optional["LiveSearcher"] = None  # the Searcher of the newest generation, lent per request
    search: Optional[SearchService] = None  # what the search and read routes call
    ready: bool = False
    status: str = "starting"  # starting | warming | ready | draining
    read_only: bool = False
    writes: Optional[WriteService] = None  # made at the first write (get_writes)
    follower: Optional[Follower] = None  # --follow: fetches what the writer publishes to object storage
    publisher: Optional[FencedWriter] = None  # --publish: the partition's writer while it holds the lease
    name: str = "default"  # the index's name (/v1/indexes/{name}/...)
    lazy: bool = False  # opens at its first request and closes when idle (every index but the default)
    indexes: Optional["IndexRegistry"] = None  # the default index's state: every index the app holds
    encoder_key: Optional[str] = None  # its share of server.shared_encoders, released when it closes
    in_flight: int = 0  # requests inside its routes now (an index closes only at 0)
    last_used: float = 0.0  # time.monotonic() of its last request's end
    closing: bool = False  # set (on the loop) before an idle close starts: requests wait for it and reopen
    documents: Optional[int] = None  # its documents when it last was open
    memory_bytes: Optional[int] = None  # estimated memory it holds when open (server.index_budget)
    deleting: bool = False  # DELETE /v1/indexes/{name} has begun: requests get 404 from now on

    def replication(self) -> Optional[dict[str, Any]]:
        """A follower's or a publishing writer's status (same lag and staleness keys), or None."""
        source = self.follower or self.publisher
        return source.status() if source is not None else None

    def require_live(self) -> "LiveSearcher":
        if self.live is None:
            raise ServiceUnavailableError(f"index is not open ({self.status})", retry_after_s=5)
        return self.live

    def require_search(self) -> SearchService:
        if self.search is None:
            raise ServiceUnavailableError(f"index is not open ({self.status})", retry_after_s=5)
        return self.search


# The dependencies are coroutines: FastAPI runs a plain `def` dependency in its thread pool, a
# thread hop per request (measured: 0.4 ms of a search's 3.9 ms of HTTP overhead) for what is
# an attribute read.
#: The ASGI scope key under which server.indexes puts the state of the index a request names.
INDEX_STATE_KEY = "espn.index_state"


def state_of(default: AppState, scope: Any) -> AppState:
    """The state of the index a request is for: the one /v1/indexes/{name}/... named, else the default."""
    return scope.get(INDEX_STATE_KEY) or default


async def get_state(request: Request) -> AppState:
    return state_of(request.app.state.espn, request.scope)


async def get_search(request: Request) -> SearchService:
    """The search service of this app (503 while the index is not open)."""
    return (await get_state(request)).require_search()


_writes_lock = threading.Lock()


def get_writes(state: AppState) -> WriteService:
    """This worker's write service, made at the first write; a 503 while the index is not open, a
    409 on a follower or a read-only index. Routes call it once their request is checked."""
    live = state.require_live()
    if state.settings.follow is not None:
        raise ApiError(409, f"this server follows {state.settings.follow} (a read replica); send writes to the "
                       "server that publishes there", code="read_only")
    if state.read_only:
        raise ApiError(409, f"this server serves {state.settings.index} read-only (--read-only, or the index is "
                       "on a read-only mount); writes are refused", code="read_only")
    with _writes_lock:
        if state.writes is None:
            state.writes = WriteService(state.settings, live, fence=state.publisher)
        return state.writes


_bearer = HTTPBearer(auto_error=False, description="the value of ESPN_API_KEY")


async def declare_api_key(credentials: Optional[HTTPAuthorizationCredentials] = Depends(_bearer)) -> None:
    """Declares the bearer scheme in the OpenAPI document (added to /v1/* only when a key is set).

    The key itself is checked by ApiKeyMiddleware, before the body is read.
    """
