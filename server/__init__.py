"""The HTTP server: a FastAPI app over one `espn.Searcher`, with no retrieval logic of its own.

`build_app(settings)` builds the app; `espn serve` (server.cli) runs it under uvicorn.
The names below load lazily: importing `server.cli` for its flags must not import
prometheus_client before `espn serve` has chosen its multiprocess mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["build_app", "create_app", "ServerSettings"]

if TYPE_CHECKING:
    from .app import build_app, create_app
    from .settings import ServerSettings


def __getattr__(name: str) -> Any:
    if name in ("build_app", "create_app"):
        from . import app  # lazily: the app loads the library (torch, FAISS); `import espn_server` stays light

        return getattr(app, name)
    if name == "ServerSettings":
        from .settings import ServerSettings  # lazily, as the app above

        return ServerSettings
    raise AttributeError(f"module 'server' has no attribute {name!r}")
