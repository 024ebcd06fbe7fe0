"""Every error the server answers on purpose, mapped to a status in one registry.

Each error body is an `ErrorResponse`: `{"error": code, "message": text, "errors": [...]}`.
Nothing here catches bare `Exception`: a bug stays a bug (uvicorn logs the traceback and
the client gets Starlette's plain 500 with no traceback in it).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

import fastapi.routing
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from espn.errors import (ConflictError, CorpusError, DocumentNotFoundError, IndexCorruptError, IndexLockedError,
                         InvalidParameterError, ReadOnlyIndexError, SlotsMovingError, StorageFullError,
                         WriteFailedError, WriterStandbyError, WriterSupersededError)
from espn.service import WrongPartitionError

from .batching import BatcherClosedError, QueueFullError

__all__ = ["ApiError", "METHOD_NOT_ALLOWED_ROUTE", "ServiceUnavailableError", "allowed_methods", "error_response", "method_not_allowed_message",
           "register_exception_handlers"]

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


class ServiceUnavailableError(ApiError):
    """Not ready yet, shutting down, or the queue is full: retry later (503 + Retry-After)."""

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(503, message, code="unavailable", headers={"Retry-After": str(retry_after_s)})


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


def _routes(app: Any) -> list[Any]:
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
    routes = [r for r in _routes(request.app)
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


async def _on_invalid_parameter(request: Request, exc: Exception) -> JSONResponse:
    return error_response(422, "invalid_parameter", str(exc))


async def _on_document_not_found(request: Request, exc: Exception) -> JSONResponse:
    return error_response(404, "document_not_found", str(exc))


async def _on_index_locked(request: Request, exc: Exception) -> JSONResponse:
    return error_response(503, "index_busy", f"{exc} (a write or a compaction is running; retry)",
                          headers={"Retry-After": "2"})


async def _on_conflict(request: Request, exc: Exception) -> JSONResponse:
    return error_response(409, "conflict", str(exc))


async def _on_wrong_partition(request: Request, exc: Exception) -> JSONResponse:
    return error_response(421, "wrong_partition", str(exc))


async def _on_read_only(request: Request, exc: Exception) -> JSONResponse:
    return error_response(409, "read_only", f"{exc} (this server serves the index read-only)")


async def _on_write_failed(request: Request, exc: Exception) -> JSONResponse:
    return error_response(503, "write_failed", str(exc), headers={"Retry-After": "2"})


async def _on_writer_superseded(request: Request, exc: Exception) -> JSONResponse:
    return error_response(503, "writer_superseded", str(exc), headers={"Retry-After": "1"})


async def _on_writer_standby(request: Request, exc: Exception) -> JSONResponse:
    return error_response(503, "writer_standby", str(exc), headers={"Retry-After": "1"})


async def _on_slots_moving(request: Request, exc: Exception) -> JSONResponse:
    return error_response(503, "slots_moving", str(exc), headers={"Retry-After": "1"})


async def _on_storage_full(request: Request, exc: Exception) -> JSONResponse:
    """The disk is full: 507 with the library's message (what was being written; nothing of it
    kept). Logged, since only the operator can free space."""
    logger.error("%s %s: %s", request.method, request.url.path, exc)
    return error_response(507, "insufficient_storage", str(exc), headers={"Retry-After": "30"})


async def _on_index_corrupt(request: Request, exc: Exception) -> JSONResponse:
    """A file of the index failed its check while serving a request: the operator's problem (logged),
    the client's answer a 503 naming it, never a traceback."""
    logger.error("%s %s: %s", request.method, request.url.path, exc)
    return error_response(503, "index_corrupt", str(exc), headers={"Retry-After": "10"})


async def _on_corpus_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(422, "invalid_document", str(exc))


async def _on_queue_full(request: Request, exc: Exception) -> JSONResponse:
    return error_response(503, "overloaded", f"search queue is full: {exc}", headers={"Retry-After": "1"})


async def _on_batcher_closed(request: Request, exc: Exception) -> JSONResponse:
    return error_response(503, "shutting_down", "the server is shutting down", headers={"Retry-After": "1"})


def register_exception_handlers(app: FastAPI) -> None:
    """The one place where exceptions become HTTP statuses."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(InvalidParameterError, _on_invalid_parameter)
    app.add_exception_handler(ConflictError, _on_conflict)  # a subclass: Starlette picks the closest handler
    app.add_exception_handler(WrongPartitionError, _on_wrong_partition)
    app.add_exception_handler(DocumentNotFoundError, _on_document_not_found)
    app.add_exception_handler(QueueFullError, _on_queue_full)
    app.add_exception_handler(IndexLockedError, _on_index_locked)
    app.add_exception_handler(CorpusError, _on_corpus_error)
    app.add_exception_handler(ReadOnlyIndexError, _on_read_only)
    app.add_exception_handler(WriteFailedError, _on_write_failed)
    app.add_exception_handler(StorageFullError, _on_storage_full)
    app.add_exception_handler(WriterSupersededError, _on_writer_superseded)
    app.add_exception_handler(WriterStandbyError, _on_writer_standby)
    app.add_exception_handler(SlotsMovingError, _on_slots_moving)  # a WriteFailedError: the closest handler wins
    app.add_exception_handler(IndexCorruptError, _on_index_corrupt)
    app.add_exception_handler(BatcherClosedError, _on_batcher_closed)
