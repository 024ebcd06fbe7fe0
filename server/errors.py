"""Every error the server answers on purpose, mapped to a status in one registry.

Each error body is an `ErrorResponse`: `{"error": code, "message": text, "errors": [...]}`.
Nothing here catches bare `Exception`: a bug stays a bug (uvicorn logs the traceback and
the client gets Starlette's plain 500 with no traceback in it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Optional

import fastapi.routing
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from espn.errors import (ConflictError, CorpusError, DocumentNotFoundError, EspnError, IndexCorruptError,
                         IndexLockedError, IndexNotFoundError, InvalidParameterError, NotEnabledError,
                         ReadOnlyIndexError, SlotsMovingError, StorageFullError, TooLargeError, UnavailableError,
                         WriteFailedError, WriterStandbyError, WriterSupersededError, WrongPartitionError)

__all__ = ["ApiError", "METHOD_NOT_ALLOWED_ROUTE", "allowed_methods", "error_response", "flat_routes", "library_error_response",
           "method_not_allowed_message", "register_exception_handlers"]

logger = logging.getLogger(__name__)

_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "body_too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    503: "unavailable",
    507: "insufficient_storage",
}


class ApiError(Exception):
    """An error the server raises itself, with its status and code."""

    def __init__(self, status_code: int, message: str, *, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code or _CODES.get(status_code, "error")
        self.message = message
        self.headers = headers


def error_response(status_code: int, code: str, message: str, *,
                   errors: Optional[list[dict[str, Any]]] = None,
                   headers: Optional[dict[str, str]] = None) -> JSONResponse:
    body: dict[str, Any] = {"error": code, "message": message}
    if errors is not None:
        body["errors"] = errors
    return JSONResponse(body, status_code=status_code, headers=headers)


def _jsonable_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validation errors without the offending input (it may be 10 MB) and JSON-safe."""
    out = []
    for error in errors:
        item = {"type": error.get("type"), "loc": list(error.get("loc", ())), "msg": error.get("msg")}
        ctx = error.get("ctx")
        if ctx:
            item["ctx"] = json.loads(json.dumps(ctx, default=str))
        out.append(item)
    return out


def _json_position(body: Any, position: int) -> str:
    """Where the JSON parser stopped, " at line L, column C (byte B)", said as the end of the body
    when it got there (a body cut short: a missing brace is found only after the last byte).

    `position` is json's, a character index into the decoded `body` (FastAPI hands over the text);
    the byte is counted in UTF-8, as the client sent it."""
    if isinstance(body, (bytes, bytearray)):
        body = bytes(body).decode("utf-8", "replace")
    if not isinstance(body, str) or not 0 <= position <= len(body):
        return f" at character {position}"
    line = body.count("\n", 0, position) + 1
    column = position - (body.rfind("\n", 0, position) + 1) + 1
    byte = len(body[:position].encode("utf-8", "surrogatepass"))
    end = ", the end of the body: is it cut short?" if position == len(body) else ""
    return f" at line {line}, column {column} (byte {byte}{end})"


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    for error in errors:
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "JSON decode error")
            position = list(error.get("loc", ()))[-1:]
            where = _json_position(exc.body, position[0]) if position and isinstance(position[0], int) else ""
            return error_response(400, "malformed_json", f"request body is not valid JSON: {reason}{where}")
    content_type = request.headers.get("content-type", "")
    if request.method in ("POST", "PUT") and "json" not in content_type.lower() and any(
            tuple(error.get("loc", ())) == ("body",) for error in errors):
        # FastAPI does not parse a body that is not declared JSON and reports a type error.
        return error_response(415, "unsupported_media_type", "request body must be JSON with Content-Type: "
                              f"application/json, got {content_type or 'no Content-Type'!r}")
    errors = _jsonable_errors(errors)
    first = errors[0] if errors else {}
    location = ".".join(str(part) for part in first.get("loc", []) if part != "body")
    message = f"{location}: {first.get('msg')}" if location else str(first.get("msg", "invalid request"))
    return error_response(422, "invalid_request", message, errors=errors)


async def _on_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = str(exc.detail)
    code = _CODES.get(exc.status_code, "error")
    # FastAPI turns any non-JSONDecodeError failure of the body parser into this 400;
    # name the usual cause (bytes that are not UTF-8) instead of "error parsing the body".
    if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
        code, message = "invalid_utf8", f"request body is not valid UTF-8: {exc.__cause__.reason}"
    headers = getattr(exc, "headers", None)
    if exc.status_code == 405:
        allowed = allowed_methods(request)
        headers = {**(headers or {}), "Allow": allowed}
        message = method_not_allowed_message(request, allowed)
    return error_response(exc.status_code, code, message, headers=headers)


#: The `name` of a route that exists only to answer 405 (e.g. the other methods of
#: /v1/documents/batch, which would otherwise reach /v1/documents/{id}): not an allowed method.
METHOD_NOT_ALLOWED_ROUTE = "method_not_allowed"
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def flat_routes(app: Any) -> list[Any]:
    """The app's routes, flat: FastAPI 0.165 wraps each included router in one route of its
    own, which `fastapi.routing.iter_route_contexts` unwraps (older FastAPI lists them flat)."""
    unwrap = getattr(fastapi.routing, "iter_route_contexts", None)
    return list(unwrap(app.routes)) if unwrap is not None else list(app.routes)


def allowed_methods(request: Request) -> str:
    """The methods this path takes, for a 405's `Allow`: per method, the first route whose
    path matches and that takes the method (as Starlette dispatches), unless that route only
    answers 405. Starlette's own 405 names only the first route's methods (GET, PUT and
    DELETE of /v1/documents/{id} are three routes)."""
    path = request.scope.get("path", "")
    routes = [r for r in flat_routes(request.app)
              if getattr(r, "methods", None) and getattr(r, "path_regex", None) is not None
              and r.path_regex.match(path)]
    allowed = []
    for method in _METHODS:
        route = next((r for r in routes if method in r.methods), None)
        if route is not None and route.name != METHOD_NOT_ALLOWED_ROUTE:
            allowed.append(method)
    return ", ".join(allowed)


def method_not_allowed_message(request: Request, allowed: str) -> str:
    return (f"method {request.method} is not allowed on {request.url.path}; it takes "
            f"{allowed or 'no method'}")


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status_code, exc.code, exc.message, headers=exc.headers)


@dataclasses.dataclass(frozen=True)
class _Status:
    """How a library error is answered: its status, its code (unless the error names its own),
    its Retry-After, and whether the operator must hear of it (logged)."""

    status: int
    code: str
    retry_after_s: Optional[int] = None
    logged: bool = False


#: Library errors by class, the most specific first (a subclass is answered as itself).
_LIBRARY: dict[type[EspnError], _Status] = {
    WrongPartitionError: _Status(421, "wrong_partition"),
    IndexNotFoundError: _Status(404, "not_found"),
    DocumentNotFoundError: _Status(404, "document_not_found"),
    NotEnabledError: _Status(404, "not_enabled"),
    ConflictError: _Status(409, "conflict"),
    ReadOnlyIndexError: _Status(409, "read_only"),
    TooLargeError: _Status(413, "too_large"),
    InvalidParameterError: _Status(422, "invalid_parameter"),
    CorpusError: _Status(422, "invalid_document"),
    IndexLockedError: _Status(503, "index_busy", retry_after_s=2),
    StorageFullError: _Status(507, "insufficient_storage", retry_after_s=30, logged=True),
    WriteFailedError: _Status(503, "write_failed", retry_after_s=2),
    WriterSupersededError: _Status(503, "writer_superseded", retry_after_s=1),
    WriterStandbyError: _Status(503, "writer_standby", retry_after_s=1),
    SlotsMovingError: _Status(503, "slots_moving", retry_after_s=1),
    IndexCorruptError: _Status(503, "index_corrupt", retry_after_s=10, logged=True),
    UnavailableError: _Status(503, "unavailable"),
}


def library_error_response(request: Request, exc: EspnError) -> Optional[JSONResponse]:
    """The answer to a library error (None: an error no status is given to, a bug to surface)."""
    status = next((_LIBRARY[cls] for cls in type(exc).__mro__ if cls in _LIBRARY), None)
    if status is None:
        return None
    retry_after = exc.retry_after_s if isinstance(exc, UnavailableError) else status.retry_after_s
    if status.logged:  # only the operator can mend it (free space, restore the index)
        logger.error("%s %s: %s", request.method, request.url.path, exc)
    return error_response(status.status, exc.code or status.code, str(exc),
                          headers={"Retry-After": str(retry_after)} if retry_after is not None else None)


async def _on_library_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EspnError)
    response = library_error_response(request, exc)
    if response is None:
        raise exc  # a bug stays a bug: uvicorn answers 500 without a traceback and logs it
    return response


def register_exception_handlers(app: FastAPI) -> None:
    """The one place where exceptions become HTTP statuses."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(EspnError, _on_library_error)
