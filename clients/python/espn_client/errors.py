"""Errors of the client: the server's answers as exceptions carrying its `error` code and `message`.

Every error the server sends on purpose has the body `{"error": CODE, "message": TEXT}` (with
`"errors": [...]` for schema violations; docs/reference/errors.md lists the codes). `ApiError`
carries them with the HTTP status; a subclass per status lets a caller catch what it handles
(`except NotFoundError`) and leave the rest. A failure to reach the server at all is a
`TransportError`, never an `ApiError`.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = [
    "EspnError", "TransportError", "RequestTimeoutError", "ApiError", "BadRequestError", "UnauthorizedError",
    "ForbiddenError", "NotFoundError", "MethodNotAllowedError", "ConflictError", "MisdirectedRequestError",
    "PayloadTooLargeError", "InvalidRequestError", "TooManyRequestsError", "UnavailableError",
    "InsufficientStorageError", "api_error",
]


class EspnError(Exception):
    """Base of every error this client raises."""


class TransportError(EspnError):
    """The server could not be reached, or the connection broke before an answer came."""


class RequestTimeoutError(TransportError):
    """No answer within the client's timeout."""


class ApiError(EspnError):
    """The server answered with an error status.

    status_code: the HTTP status; code: the body's `error` (e.g. `invalid_parameter`);
    message: the body's `message`; errors: per-field validation errors of a 422 (or None);
    retry_after_s: the `Retry-After` the server sent, in seconds (or None)."""

    def __init__(self, status_code: int, code: str, message: str, *, errors: Optional[list[dict[str, Any]]] = None,
                 retry_after_s: Optional[float] = None, method: str = "", url: str = "") -> None:
        super().__init__(f"{status_code} {code}: {message}")
        self.status_code = status_code
        self.code = code
        self.message = message
        self.errors = errors
        self.retry_after_s = retry_after_s
        self.method = method
        self.url = url


class BadRequestError(ApiError):
    """400: malformed JSON, invalid UTF-8."""


class UnauthorizedError(ApiError):
    """401: no API key, or a wrong one."""


class ForbiddenError(ApiError):
    """403."""


class NotFoundError(ApiError):
    """404: no such document (`document_not_found`), snapshots off (`snapshots_off`), no such path."""


class MethodNotAllowedError(ApiError):
    """405: e.g. a write to a router started without writers."""


class ConflictError(ApiError):
    """409: a write that contradicts itself or the index (`conflict`), or a read-only server (`read_only`)."""


class MisdirectedRequestError(ApiError):
    """421: an id another partition owns (`wrong_partition`): write through the router."""


class PayloadTooLargeError(ApiError):
    """413: the body is over the server's --max-body-bytes."""


class InvalidRequestError(ApiError):
    """422: a field out of bounds (`invalid_request`), a parameter out of range for this index
    (`invalid_parameter`), an unsearchable query, a refused document, a request over budget."""


class TooManyRequestsError(ApiError):
    """429."""


class UnavailableError(ApiError):
    """503: not ready, overloaded, the index busy, a write failed, shutting down (retried by the client)."""


class InsufficientStorageError(ApiError):
    """507: the server's disk is full; nothing of the write was kept (retried by the client)."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequestError, 401: UnauthorizedError, 403: ForbiddenError, 404: NotFoundError,
    405: MethodNotAllowedError, 409: ConflictError, 413: PayloadTooLargeError, 421: MisdirectedRequestError,
    422: InvalidRequestError, 429: TooManyRequestsError, 503: UnavailableError, 507: InsufficientStorageError,
}


def api_error(status_code: int, body: Any, text: str, *, retry_after_s: Optional[float] = None, method: str = "",
              url: str = "") -> ApiError:
    """The exception for an error answer: the body's `error` and `message` when it is the server's
    JSON error body, else `http_<status>` and the body's text (a proxy's HTML page, a plain 500)."""
    cls = _BY_STATUS.get(status_code, ApiError)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        errors = body.get("errors")
        return cls(status_code, body["error"], str(body.get("message", "")),
                   errors=errors if isinstance(errors, list) else None, retry_after_s=retry_after_s,
                   method=method, url=url)
    return cls(status_code, f"http_{status_code}", text.strip()[:2000] or "(no body)", retry_after_s=retry_after_s,
               method=method, url=url)
