"""`/v1/indexes/{name}/...` through the router: the same routes, forwarded to each shard's index `name`.

`RouterIndexRoutes` hands a request for `/v1/indexes/{name}/search` (or `.../search/batch`,
`.../documents/...`) to the router's own `/v1/search` route with `name` in a context
variable; `shard_path` then turns the path each shard or writer is sent (`/v1/search`) into
`/v1/indexes/{name}/search`. Tasks the routes start (the fan-out's `asyncio.gather`) copy the
context, so every partition's request names the index. A name the shards do not hold is
their 404 `not_found`, passed on.
"""

from __future__ import annotations

import contextvars
from typing import Optional

from starlette.types import ASGIApp, Receive, Scope, Send

from ..errors import error_response
from ..index_names import is_index_name

__all__ = ["RouterIndexRoutes", "shard_path", "ROUTED"]

_PREFIX = "/v1/indexes/"
#: What the router forwards per index: its searches and its documents (reads and writes).
ROUTED = frozenset({"search", "documents"})
_INDEX: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("espn_router_index", default=None)


def shard_path(path: str) -> str:
    """The path to send a shard for this request: under /v1/indexes/{name}/ when the request named an index."""
    name = _INDEX.get()
    if name is None or not path.startswith("/v1/"):
        return path
    return f"{_PREFIX}{name}/{path[len('/v1/'):]}"


class RouterIndexRoutes:
    """`/v1/indexes/{name}/<route>` -> the router's `/v1/<route>`, for index `name` (see the module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(_PREFIX):
            await self.app(scope, receive, send)
            return
        name, _, tail = path[len(_PREFIX):].partition("/")
        raw_prefix = f"{_PREFIX}{name}/".encode()
        raw_path: bytes = scope.get("raw_path") or path.encode()
        if (not is_index_name(name) or tail.split("/", 1)[0] not in ROUTED
                or not raw_path.startswith(raw_prefix)):
            await error_response(404, "not_found", f"no route {path!r}: the router forwards "
                               f"{', '.join(sorted(ROUTED))} under {_PREFIX}{{name}}/")(scope, receive, send)
            return
        inner = dict(scope)
        inner["path"] = "/v1/" + tail
        inner["raw_path"] = b"/v1/" + raw_path[len(raw_prefix):]
        token = _INDEX.set(name)
        try:
            await self.app(inner, receive, send)
        finally:
            _INDEX.reset(token)
