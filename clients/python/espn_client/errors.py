"""Errors of the client: the server's answers as exceptions carrying its `error` code and `message`.

Every error the server sends on purpose has the body `{"error": CODE, "message": TEXT}` (with
`"errors": [...]` for schema violations; docs/reference/errors.md lists the codes). `ApiError`
carries them with the HTTP status; a subclass per status lets a caller catch what it handles
(`except NotFoundError`) and leave the rest. A failure to reach the server at all is a
`TransportError`, never an `ApiError`; an answer the client cannot take (larger than its cap,
HTML where JSON was due, the wrong shape, nested too deep) is a `ResponseError`. Every error
carries what came: the answer's status (None when none came) and the start of its body.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = [
    "EspnError", "TransportError", "RequestTimeoutError", "DeadlineExceededError", "ResponseError",
    "ResponseTooLargeError", "MalformedResponseError", "ApiError", "BadRequestError", "UnauthorizedError",
    "ForbiddenError", "NotFoundError", "MethodNotAllowedError", "ConflictError", "MisdirectedRequestError",
    "PayloadTooLargeError", "InvalidRequestError", "TooManyRequestsError", "UnavailableError",
    "InsufficientStorageError", "api_error",
]


class EspnError(Exception):
    """Base of every error this client raises.

    status_code: the HTTP status of the answer, or None when no answer came; excerpt: the start
    of its body as text ("" when none came); method and url: the request's."""

    def __init__(self, message: str, *, status_code: Optional[int] = None, excerpt: str = "", method: str = "",
                 url: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.excerpt = excerpt
        self.method = method
        self.url = url


class TransportError(EspnError):
    """The server could not be reached, or the connection broke before the whole answer came."""


class RequestTimeoutError(TransportError):
    """Nothing came within the client's timeout (connecting, sending, or one read)."""


class DeadlineExceededError(RequestTimeoutError):
    """The call ran past its deadline (`deadline_s`: its tries, their waits and the reading of
    the answer together), e.g. an answer trickled a byte at a time."""


class ResponseError(EspnError):
    """An answer the client cannot take; `status_code` and `excerpt` say what came."""


class ResponseTooLargeError(ResponseError):
    """The answer's body passed `max_answer_bytes` (counted after decompression): the read stopped there."""


class MalformedResponseError(ResponseError):
    """The answer is not what its route returns: not JSON (an HTML page), the wrong shape, nested
    too deep, or in a content encoding the client does not read."""


class ApiError(EspnError):
    """The server answered with an error status.

    status_code: the HTTP status; code: the body's `error` (e.g. `invalid_parameter`);
    message: the body's `message`; errors: per-field validation errors of a 422 (or None);
    retry_after_s: the `Retry-After` the server sent, in seconds (or None); excerpt: the start of
    the body as text."""

    status_code: int

    def __init__(self, status_code: int, code: str, message: str, *, errors: Optional[list[dict[str, Any]]] = None,
                 retry_after_s: Optional[float] = None, method: str = "", url: str = "", excerpt: str = "") -> None:
        super().__init__(f"{status_code} {code}: {message}", status_code=status_code, excerpt=excerpt, method=method,
                         url=url)
        self.code = code
        self.message = message
        self.errors = errors
        self.retry_after_s = retry_after_s


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


def api_error(status_code: int, body: Any, excerpt: str, *, retry_after_s: Optional[float] = None,
              method: str = "", url: str = "") -> ApiError:
    """The exception for an error answer: the body's `error` and `message` when it is the server's
    JSON error body, else `http_<status>` and the body's excerpt (a proxy's HTML page, a plain 500)."""
    cls = _BY_STATUS.get(status_code, ApiError)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        errors = body.get("errors")
        return cls(status_code, body["error"], str(body.get("message", "")),
                   errors=errors if isinstance(errors, list) else None, retry_after_s=retry_after_s,
                   method=method, url=url, excerpt=excerpt)
    return cls(status_code, f"http_{status_code}", excerpt or "(no body)", retry_after_s=retry_after_s,
               method=method, url=url, excerpt=excerpt)
