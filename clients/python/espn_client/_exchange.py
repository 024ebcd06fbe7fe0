"""One call and its answers, without I/O: the call's deadline, each answer read under a byte cap
(counted after decompression), and whether a failure is tried again.

The clients drive it from their transport loops (async_client.py, and client.py generated from
it): they send, feed each raw chunk of the body to an `AnswerReader`, and hand every failure to
`Exchange.wait_after`. What comes from the server is data: its size, its pace and its shape are
checked here, and each refusal is an `espn_client` error carrying the status and an excerpt.
"""

from __future__ import annotations

import re
import time
import zlib
from typing import Any, Generic, Optional, TypeVar, Union

import httpx
from pydantic import ValidationError

from ._core import Answer, Call, RetryPolicy, retry_after_s
from .errors import (ApiError, DeadlineExceededError, EspnError, MalformedResponseError, RequestTimeoutError,
                     ResponseTooLargeError, TransportError, api_error)

__all__ = ["DEFAULT_DEADLINE_S", "DEFAULT_MAX_ANSWER_BYTES", "MAX_ERROR_BODY_BYTES", "EXCERPT_CHARS",
           "INFLATE_STEP_BYTES", "ACCEPT_ENCODING", "Deadline", "AnswerReader", "Exchange", "excerpt", "error_of",
           "result_of"]

T = TypeVar("T")
E = TypeVar("E", bound=EspnError)

#: Seconds one call may take in all: its tries, the waits between them and the reading of each
#: answer (httpx's timeouts bound each read, not the whole). A build has its own (create_index).
DEFAULT_DEADLINE_S = 120.0
#: The most bytes of one answer's body the client holds, counted after decompression: 4 x the
#: server's largest response by default (ESPN_MAX_RESPONSE_BYTES, 16 MiB). The read stops there.
DEFAULT_MAX_ANSWER_BYTES = 64 << 20
#: The most bytes read of an error answer's body (the server's are under a few KB; a 422 for a
#: batch of 1,000 documents, a few hundred KB): past it the rest is not read.
MAX_ERROR_BODY_BYTES = 1 << 20
#: Characters of the body an error carries as `excerpt`.
EXCERPT_CHARS = 200
#: Bytes one decompression step may produce: with the cap, what a compressed answer can make the
#: client hold (a deflate stream inflates up to ~1,000 x; unbounded, 64 KiB read would be 64 MiB).
INFLATE_STEP_BYTES = 1 << 20
#: The encodings the client asks for and reads (zlib's, so that inflating is bounded).
ACCEPT_ENCODING = "gzip, deflate"


def excerpt(content: Union[bytes, bytearray]) -> str:
    """The start of a body as one line of text (invalid UTF-8 replaced, runs of whitespace one space)."""
    text = bytes(content[:EXCERPT_CHARS * 4]).decode("utf-8", "replace")
    line = re.sub(r"\s+", " ", text).strip()
    return line if len(line) <= EXCERPT_CHARS else line[:EXCERPT_CHARS] + "..."


def error_of(answer: Answer) -> ApiError:
    """An error status as the client's exception: the server's code and message when the body is its
    JSON error body, else `http_<status>` and the excerpt."""
    try:
        body: Any = answer.json()
    except ValueError:
        body = None
    return api_error(answer.status_code, body, excerpt(answer.content),
                     retry_after_s=retry_after_s(answer.headers.get("retry-after")), method=answer.method,
                     url=answer.url)


def result_of(call: Call[T], answer: Answer) -> T:
    """The call's result, or the client's error: ApiError for an error status, MalformedResponseError
    for an answer its parser refuses (not JSON, the wrong shape, nested too deep)."""
    if answer.status_code not in call.ok:
        raise error_of(answer)
    try:
        return call.parse(answer)
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        raise MalformedResponseError(
            f"{answer.method} {answer.url}: the answer (status {answer.status_code}, {len(answer.content)} bytes) is "
            f"{_what_is_wrong(call, exc)}; it begins: {excerpt(answer.content)!r}",
            status_code=answer.status_code, excerpt=excerpt(answer.content), method=answer.method,
            url=answer.url) from exc


def _what_is_wrong(call: Call[Any], exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the body"
        what = call.expects or f"a {exc.title}"
        return f"not {what}: {exc.error_count()} error(s), the first at {where}: {first['msg']}"
    return f"not {call.expects or 'what the route returns'}: {exc}"


class Deadline:
    """When one call must be over (monotonic clock); seconds=None: no deadline."""

    def __init__(self, seconds: Optional[float]) -> None:
        if seconds is not None and not seconds > 0:
            raise ValueError(f"deadline_s: seconds above 0, or None for no deadline; got {seconds!r}")
        self.seconds = seconds
        self.at = None if seconds is None else time.monotonic() + seconds

    def left_s(self) -> Optional[float]:
        return None if self.at is None else self.at - time.monotonic()

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def allows_wait(self, wait_s: float) -> bool:
        return self.at is None or time.monotonic() + wait_s < self.at

    def clamp(self, timeout: Union[float, None, httpx.Timeout]) -> Union[float, httpx.Timeout]:
        """httpx's timeouts, none longer than the time left (as given when they all fit): a read
        that starts before the deadline ends by it or one read later (the sync client checks the
        deadline between reads)."""
        left = self.left_s()
        if left is None:
            return httpx.Timeout(None) if timeout is None else timeout
        if not isinstance(timeout, httpx.Timeout):
            return timeout if timeout is not None and timeout <= left else max(left, 0.001)
        parts = (timeout.connect, timeout.read, timeout.write, timeout.pool)
        if all(part is not None and part <= left for part in parts):
            return timeout
        clamped = [max(left, 0.001) if part is None else min(part, max(left, 0.001)) for part in parts]
        return httpx.Timeout(connect=clamped[0], read=clamped[1], write=clamped[2], pool=clamped[3])


class _Inflater:
    """zlib's gzip or deflate decoder (HTTP's "deflate" is zlib-wrapped, but some servers send it bare)."""

    def __init__(self, encoding: str) -> None:
        self.bare_fallback = encoding == "deflate"
        self.zlib = zlib.decompressobj(zlib.MAX_WBITS if encoding == "deflate" else zlib.MAX_WBITS | 16)

    def decompress(self, data: bytes, max_length: int) -> tuple[bytes, bytes]:
        """At most `max_length` bytes of output, and the input not yet consumed."""
        try:
            piece = self.zlib.decompress(data, max_length)
        except zlib.error:
            if not self.bare_fallback:
                raise
            self.bare_fallback = False
            self.zlib = zlib.decompressobj(-zlib.MAX_WBITS)
            piece = self.zlib.decompress(data, max_length)
        self.bare_fallback = False
        return piece, self.zlib.unconsumed_tail


class AnswerReader:
    """One answer's body, decoded as it arrives and never held past its cap.

    An answer (a status in `call.ok`) over `max_bytes` raises ResponseTooLargeError, at once
    when its Content-Length says so; an error answer is read up to MAX_ERROR_BODY_BYTES and the
    rest left unread. Each chunk is taken only before the deadline."""

    def __init__(self, response: httpx.Response, call: Call[Any], max_bytes: int, deadline: Deadline) -> None:
        self.status_code = response.status_code
        self.headers = response.headers
        self.request = response.request
        self.deadline = deadline
        self.is_answer = self.status_code in call.ok
        self.limit = max_bytes if self.is_answer else min(max_bytes, MAX_ERROR_BODY_BYTES)
        self.body = bytearray()
        self.truncated = False
        # A transport that hands over a body it has read and decoded itself (httpx.MockTransport,
        # a Response made with content=): fed whole, as identity.
        self.already_read = response.is_stream_consumed
        encoding = "identity" if self.already_read else response.headers.get("content-encoding", "identity")
        encoding = encoding.strip().lower()
        if encoding in ("gzip", "x-gzip", "deflate"):
            self.inflater: Optional[_Inflater] = _Inflater(encoding)
        elif encoding in ("", "identity"):
            self.inflater = None
            declared = response.headers.get("content-length", "")
            if self.is_answer and declared.isdigit() and int(declared) > self.limit:
                raise self._too_large(f"its Content-Length says {int(declared)} bytes")
        else:
            raise self.error(MalformedResponseError, f"in content encoding {encoding!r}, which the client does not "
                                                     f"read (it asks for {ACCEPT_ENCODING})")
        self.check_deadline()

    def feed(self, raw: bytes) -> bool:
        """Take the next raw chunk of the body; False when no more is wanted (an error body at its cap)."""
        self.check_deadline()
        if self.inflater is None:
            return self._take(raw)
        try:
            return self._inflate(self.inflater, raw)
        except zlib.error as exc:
            encoding = self.headers.get("content-encoding")
            raise self.error(MalformedResponseError, f"not valid {encoding} ({exc})") from exc

    def _inflate(self, inflater: _Inflater, raw: bytes) -> bool:
        """Decode in steps of at most INFLATE_STEP_BYTES, each taken before the next is made: one
        byte past the cap is as far as a bomb gets."""
        pending = raw
        while True:
            room = max(1, min(self.limit + 1 - len(self.body), INFLATE_STEP_BYTES))
            piece, pending = inflater.decompress(pending, room)
            if piece and not self._take(piece):
                return False
            if not piece or (not pending and len(piece) < room):  # all consumed, nothing held back in zlib
                return True

    def _take(self, piece: bytes) -> bool:
        room = self.limit - len(self.body)
        self.body += piece[:room]
        if len(piece) <= room:
            return True
        if self.is_answer:
            raise self._too_large("more than that")
        self.truncated = True
        return False

    def check_deadline(self) -> None:
        if self.deadline.passed():
            raise self.error(DeadlineExceededError, f"still arriving at the deadline ({self.deadline.seconds} s; "
                                                    f"{len(self.body)} bytes read)")

    def answer(self) -> Answer:
        return Answer(self.status_code, self.headers, bytes(self.body), self.request, self.truncated)

    def broken(self, exc: httpx.HTTPError) -> EspnError:
        """What a failure while the body arrived becomes (never tried again: the server may have acted)."""
        if self.deadline.passed():
            return self.error(DeadlineExceededError, f"still arriving at the deadline ({self.deadline.seconds} s)")
        kind = RequestTimeoutError if isinstance(exc, httpx.TimeoutException) else TransportError
        return self.error(kind, f"broken off after {len(self.body)} bytes ({type(exc).__name__}: {exc})")

    def error(self, kind: type[E], what: str) -> E:
        method, url = self.request.method, str(self.request.url)
        return kind(f"{method} {url}: the answer (status {self.status_code}) is {what}; it begins: "
                    f"{excerpt(self.body)!r}", status_code=self.status_code, excerpt=excerpt(self.body),
                    method=method, url=url)

    def _too_large(self, how: str) -> EspnError:
        return self.error(ResponseTooLargeError, f"over max_answer_bytes ({self.limit} bytes, counted decompressed): "
                                                 f"{how}; the read stopped there")


class Exchange(Generic[T]):
    """One call's tries: the timeouts of each, its answer's reader, and what each failure becomes
    (a wait before the next try, or the client's error)."""

    def __init__(self, call: Call[T], base_url: str, timeout: Union[float, httpx.Timeout], retry: RetryPolicy,
                 deadline_s: Optional[float], max_answer_bytes: int) -> None:
        self.call = call
        self.url = base_url + call.path
        self.retry = retry
        self.timeout = timeout if call.timeout is None else call.timeout
        self.deadline = Deadline(deadline_s if call.timeout is None else max(call.timeout, deadline_s or 0.0))
        self.max_answer_bytes = max_answer_bytes
        self.attempt = 0
        self.reader: Optional[AnswerReader] = None

    def start(self) -> Union[float, httpx.Timeout]:
        """The next try begins: httpx's timeouts for it."""
        self.attempt += 1
        self.reader = None
        return self.deadline.clamp(self.timeout)

    def read(self, response: httpx.Response) -> AnswerReader:
        self.reader = AnswerReader(response, self.call, self.max_answer_bytes, self.deadline)
        return self.reader

    def result(self, answer: Answer) -> T:
        return result_of(self.call, answer)

    def wait_after(self, failure: Exception) -> float:
        """Seconds to wait before the next try, or the failure raised as the client's error: a
        503/507 and a connection never opened are tried again within the policy and the deadline."""
        where = f"{self.call.method} {self.url}"
        if isinstance(failure, ApiError):
            wait = self._wait(failure.retry_after_s) if failure.status_code in self.retry.statuses else None
            if wait is None:
                raise failure
            return wait
        if isinstance(failure, httpx.TimeoutException):
            if self.deadline.passed():
                raise self.expired() from failure
            raise RequestTimeoutError(f"{where}: nothing came within the timeout ({type(failure).__name__}: "
                                      f"{failure})", method=self.call.method, url=self.url) from failure
        wait = self._wait(None) if isinstance(failure, httpx.ConnectError) else None
        if wait is None:
            raise TransportError(f"{where}: {type(failure).__name__}: {failure}", method=self.call.method,
                                 url=self.url) from failure
        return wait

    def _wait(self, retry_after_s: Optional[float]) -> Optional[float]:
        wait = self.retry.delay_s(self.attempt, retry_after_s) if self.call.retry else None
        return wait if wait is not None and self.deadline.allows_wait(wait) else None

    def expired(self) -> DeadlineExceededError:
        """The error of a call past its deadline, with what its last answer had brought."""
        if self.reader is not None:
            what = f"still arriving at the deadline ({self.deadline.seconds} s)"
            return self.reader.error(DeadlineExceededError, what)
        return DeadlineExceededError(f"{self.call.method} {self.url}: no answer within the deadline "
                                     f"({self.deadline.seconds} s, {self.attempt} tries)", method=self.call.method,
                                     url=self.url)
