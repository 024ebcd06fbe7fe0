"""Pure ASGI middleware: the request log and metrics, and the request body limit.

Pure ASGI (not BaseHTTPMiddleware) so that nothing buffers responses or changes how
cancellation reaches the routes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import Any, Optional

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from espn.errors import RefusedInputError
from espn.engine import RULES

from .auth import Keyring, required
from .errors import error_response
from .logs import ACCESS_LOGGER
from .metrics import ServerMetrics

__all__ = ["AccessMiddleware", "AuthMiddleware", "PRINCIPAL_KEY", "BodyLimitMiddleware", "CancelledRequestMiddleware", "LOG_EXTRA_KEY",
           "read_body", "replay_body"]

access_logger = logging.getLogger(ACCESS_LOGGER)
logger = logging.getLogger(__name__)

# Routes put fields for the request's log line in request.state under this name.
LOG_EXTRA_KEY = "log_extra"
#: Where AuthMiddleware leaves the request's principal (server.auth.Principal, or None) in its state.
PRINCIPAL_KEY = "principal"

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

# A body larger than this has its depth counted in a thread: the scan takes about 10 ms a MiB
# of brackets, which the event loop should not spend while other requests wait on it.
_DEPTH_IN_THREAD_BYTES = 1 << 20


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


async def read_body(receive: Receive, max_bytes: Optional[int] = None) -> bytes | None:
    """The whole body, or its first max_bytes + 1 bytes; None when the client left."""
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body = message.get("body", b"")
        total += len(body)
        chunks.append(body)
        if (max_bytes is not None and total > max_bytes) or not message.get("more_body", False):
            return b"".join(chunks)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """`receive` for an app after the body was read: `body` once, then the real `receive` (which
    waits for the disconnect, as Starlette expects)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class AccessMiddleware:
    """Counts, times and logs every HTTP request (one structured line each); sets X-Request-ID.

    The line names the path, never the query string (it may carry a key) nor a header."""

    def __init__(self, app: ASGIApp, metrics: Optional[ServerMetrics], routes: list[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes  # matched in order to label a request by its route template
        # (method, path) -> label, for the paths that are their own template (no path parameter):
        # a search is labelled without matching every route; document ids and unknown paths are
        # matched each time, so the dict stays as small as the route table.
        self._static: dict[tuple[str, str], str] = {}

    def _endpoint(self, scope: Scope) -> str:
        # The template ("/v1/documents/{doc_id}", "/v1/indexes/{index}/search"), never the raw path:
        # bounded label cardinality.
        key = (scope["method"], scope["path"])
        known = self._static.get(key)
        if known is not None:
            return known
        partial = "other"
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                label = str(getattr(route, "path_format", None) or getattr(route, "path", "other"))
                if label == key[1]:
                    self._static[key] = label
                return label
            if match is Match.PARTIAL and partial == "other":  # right path, wrong method
                partial = str(getattr(route, "path_format", None) or getattr(route, "path", "other"))
        return partial

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = _header(scope, b"x-request-id")
        request_id = incoming if incoming and _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        status = 500  # what the client gets if the app raises before answering
        started = time.perf_counter()
        endpoint = self._endpoint(scope)
        in_flight = self.metrics.in_flight.labels(endpoint) if self.metrics is not None else None
        if in_flight is not None:
            in_flight.inc()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            if in_flight is not None and self.metrics is not None:
                in_flight.dec()
                self.metrics.observe_request(endpoint, scope["method"], status, seconds)
            extra: dict[str, Any] = {}
            state = scope.get("state")
            if isinstance(state, dict) and isinstance(state.get(LOG_EXTRA_KEY), dict):
                extra = state[LOG_EXTRA_KEY]
            client = scope.get("client")
            access_logger.info(
                "request",
                extra={
                    "request_id": request_id,
                    "method": scope["method"],
                    "path": scope["path"],
                    "endpoint": endpoint,
                    "status": status,
                    "duration_ms": round(seconds * 1000.0, 3),
                    "client": f"{client[0]}:{client[1]}" if client else None,
                    **extra,
                },
            )


class AuthMiddleware:
    """API keys, checked before anything reads the body: `Authorization: Bearer <key>` on every
    path under `prefix`, and the key's role on the index the request acts on (server.auth).

    As a route dependency the check would run only after FastAPI parsed the body, so a
    request without the key but with malformed JSON got a 400 instead of a 401: it could
    learn about the API without the key. Here the request stops at its headers. The key's
    principal (or None, for a request without a valid key) is left in the request's state for
    the routes that show only what it reaches (the listing of indexes, /readyz).
    """

    def __init__(self, app: ASGIApp, keyring: Keyring, default_index: Optional[str], prefix: str = "/v1/") -> None:
        self.app = app
        self.keyring = keyring
        self.default_index = default_index
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scheme, _, token = (_header(scope, b"authorization") or "").partition(" ")
        principal = self.keyring.principal(token.strip()) if scheme.lower() == "bearer" else None
        scope.setdefault("state", {})[PRINCIPAL_KEY] = principal
        if not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        if principal is None:
            response = error_response(401, "unauthorized", "missing or wrong API key (Authorization: Bearer <key>)",
                                      headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        index, role = required(scope["path"], scope["method"], self.default_index)
        if not principal.may(role, index):
            on = f" on index {index!r}" if index is not None else ""
            response = error_response(403, "forbidden", f"the API key {principal.name!r} ({principal.role}) may not "
                                      f"{scope['method']} {scope['path']}: it needs the {role} role{on}")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the request body up to `max_bytes` within `timeout_s`, answering 413 beyond the size
    and 408 beyond the time (a body trickling a byte a second holds a connection no longer),
    and 400 `malformed_json` when it nests deeper than `max_depth` (espn.untrusted's rule).

    A declared Content-Length over the limit is refused before reading anything; a
    chunked body is counted as it arrives. The body is buffered (it is small by then)
    and replayed to the app. The depth is checked here, once, for every route and the
    search fast path, before any parser sees the body: Python's json raises RecursionError
    near 1,000 levels, pydantic sooner on some paths, and either would be a 500. Every body
    is checked whatever its Content-Type (every body this API takes is JSON; a route answers
    another type with 415).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 30.0, max_depth: int = RULES.max_json_depth) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await error_response(400, "bad_request", "invalid Content-Length header")(scope, receive, send)
                return
            if int(declared) > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
        try:
            async with asyncio.timeout(self.timeout_s):
                buffered = await read_body(receive, self.max_bytes)
        except TimeoutError:
            response = error_response(408, "request_timeout", f"the request body did not arrive within "
                                      f"{self.timeout_s:g} s", headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        if buffered is None:
            return  # the client left before sending its body
        if len(buffered) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        try:
            if len(buffered) > _DEPTH_IN_THREAD_BYTES:
                await asyncio.to_thread(RULES.check_json_depth, buffered, "request body", self.max_depth)
            else:
                RULES.check_json_depth(buffered, "request body", self.max_depth)
        except RefusedInputError as exc:
            await error_response(400, "malformed_json", str(exc))(scope, receive, send)
            return
        await self.app(scope, replay_body(buffered, receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(413, "body_too_large", f"request body exceeds {self.max_bytes} bytes",
                                  headers={"Connection": "close"})
        await response(scope, receive, send)


class CancelledRequestMiddleware:
    """A request cancelled at the shutdown deadline gets a JSON 503, not uvicorn's plain 500.

    Past `--graceful-timeout` uvicorn cancels the tasks still running; the CancelledError
    would reach uvicorn, which logs it as a traceback and answers "Internal Server Error".
    Here it ends the request instead: one log line, a 503 the client may retry elsewhere.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            logger.warning("request cancelled at the shutdown deadline", extra={"path": scope.get("path")})
            if not started:
                response = error_response(503, "shutting_down", "the server shut down before this request finished; "
                                          "retry", headers={"Retry-After": "1", "Connection": "close"})
                await response(scope, receive, send)
