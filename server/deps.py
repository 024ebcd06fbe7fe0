"""What routes depend on: the per-app state, and the API key's declaration in the OpenAPI document."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .errors import ServiceUnavailableError
from .metrics import ServerMetrics
from .settings import ServerSettings

if TYPE_CHECKING:  # the library pulls in torch and faiss; routes only need the type
    from espn import Searcher

    from .batching import MicroBatcher

__all__ = ["AppState", "get_state", "declare_api_key"]

logger = logging.getLogger(__name__)

#: A Searcher replaced by a newer generation is closed this long after (in-flight searches end first).
RETIRE_AFTER_S = 60.0


@dataclasses.dataclass
class AppState:
    """Everything one app instance owns; created by build_app, filled by its lifespan."""

    settings: ServerSettings
    metrics: ServerMetrics
    searcher: Optional["Searcher"] = None
    batcher: Optional["MicroBatcher"] = None
    text_bytes: float = 0.0  # mean bytes of a passage's title and text (for the response budget)
    ready: bool = False
    status: str = "starting"  # starting | warming | ready | draining
    retired: list[tuple[float, "Searcher"]] = dataclasses.field(default_factory=list)
    compacting: bool = False
    write_encoder: Any = None  # the encoder writes use, loaded at the first write (server/routes/documents.py)

    def require_searcher(self) -> "Searcher":
        """The Searcher of the newest published generation: one stat of live/CURRENT per call; when
        a write (in any worker) published a newer one, it opens here before the request goes on."""
        if self.searcher is None:
            raise ServiceUnavailableError(f"index is not open ({self.status})", retry_after_s=5)
        self.refresh()
        return self.searcher

    def require_searcher_unrefreshed(self) -> "Searcher":
        """The Searcher in use, without looking for a newer generation (from worker threads)."""
        if self.searcher is None:
            raise ServiceUnavailableError(f"index is not open ({self.status})", retry_after_s=5)
        return self.searcher

    def refresh(self) -> None:
        """Swap in the newest generation (on the event loop: never two swaps at once)."""
        if self.searcher is None:
            return
        try:
            newer = self.searcher.refresh()
        except Exception:  # a generation that fails to open: keep serving the one we have
            logger.exception("could not open the newest generation; still serving generation %d",
                             self.searcher.generation)
            return
        now = time.monotonic()
        if newer is not None:
            self.retired.append((now, self.searcher))
            self.searcher = newer
            logger.info("serving generation %d", newer.generation)
        while self.retired and now - self.retired[0][0] > RETIRE_AFTER_S:
            self.retired.pop(0)[1].close()

    def require_batcher(self) -> "MicroBatcher":
        if self.batcher is None:
            raise ServiceUnavailableError(f"index is not open ({self.status})", retry_after_s=5)
        return self.batcher


def get_state(request: Request) -> AppState:
    return request.app.state.espn


_bearer = HTTPBearer(auto_error=False, description="the value of ESPN_API_KEY")


async def declare_api_key(credentials: Optional[HTTPAuthorizationCredentials] = Depends(_bearer)) -> None:
    """Declares the bearer scheme in the OpenAPI document (added to /v1/* only when a key is set).

    The key itself is checked by ApiKeyMiddleware, before the body is read.
    """
