"""What routes depend on: the per-app state and the API-key check."""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
from typing import TYPE_CHECKING, Iterator, Optional

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import ApiError, ServiceUnavailableError
from .metrics import ServerMetrics
from .settings import ServerSettings

if TYPE_CHECKING:  # the library pulls in torch and faiss; routes only need the types
    from espn import Searcher
    from espn.lease import LiveSearcher
    from espn_indexing.commit import GroupCommit

    from .batching import MicroBatcher

__all__ = ["AppState", "get_state", "require_api_key"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class AppState:
    """Everything one app instance owns; created by build_app, filled by its lifespan."""

    settings: ServerSettings
    metrics: ServerMetrics
    live: Optional["LiveSearcher"] = None  # the Searcher of the newest generation, lent per request
    batcher: Optional["MicroBatcher"] = None
    text_bytes: float = 0.0  # mean bytes of a passage's title and text (for the response budget)
    ready: bool = False
    status: str = "starting"  # starting | warming | ready | draining
    read_only: bool = False
    writer: Optional["GroupCommit"] = None  # made at the first write (server/routes/documents.py)
    compacting: bool = False

    def require_live(self) -> "LiveSearcher":
        if self.live is None:
            raise ServiceUnavailableError(f"index is not open ({self.status})", retry_after_s=5)
        return self.live

    @contextlib.contextmanager
    def lease(self) -> Iterator["Searcher"]:
        """The Searcher of the newest published generation, held for the block: one stat of
        live/CURRENT per call; when a write (in any worker) published a newer generation, it
        opens here first, so a request that starts after a write's answer sees the write."""
        live = self.require_live()
        live.refresh()
        with live.lease() as searcher:
            yield searcher

    def require_batcher(self) -> "MicroBatcher":
        if self.batcher is None:
            raise ServiceUnavailableError(f"index is not open ({self.status})", retry_after_s=5)
        return self.batcher


def get_state(request: Request) -> AppState:
    return request.app.state.espn


_bearer = HTTPBearer(auto_error=False, description="the value of ESPN_API_KEY, when it is set")


async def require_api_key(
    request: Request, credentials: Optional[HTTPAuthorizationCredentials] = Depends(_bearer)
) -> None:
    """Check `Authorization: Bearer <ESPN_API_KEY>` when a key is configured."""
    expected = get_state(request).settings.api_key
    if expected is None:
        return
    given = credentials.credentials if credentials is not None else ""
    # compare_digest: the time taken does not reveal how much of the key matched.
    if not hmac.compare_digest(given.encode(), expected.get_secret_value().encode()):
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                       headers={"WWW-Authenticate": "Bearer"})
