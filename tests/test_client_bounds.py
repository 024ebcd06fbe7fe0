"""The typed client against a hostile server: what it reads is bounded in size, time and shape.

A real HTTP server on loopback, started here, answers each route by the first segment of its
path (the client's base URL carries it: `Client(URL + "/bomb")` sends `POST /bomb/v1/search`):
a gzip bomb (1 MB that inflates to 1 GiB), a 400 MB answer streamed without a length, a body
trickled a byte every 2 s, headers that never come, HTML where JSON is due, the wrong shape,
JSON nested 100,000 deep, bodies cut short, an encoding the client does not read. Each must end
as an `espn_client` error carrying the status and an excerpt of the body, within the call's
deadline (generous slack for a loaded machine) and, for the big ones, within a stated bound on
the client process's peak RSS, measured in a subprocess of its own (ru_maxrss).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import subprocess
import sys
import threading
import time
import zlib
from typing import Any, Callable, Iterator

import pytest
from helpers import HTTP_TIMEOUT_S

import espn_client
from espn_client import (AsyncClient, Client, DeadlineExceededError, MalformedResponseError, RequestTimeoutError,
                         ResponseTooLargeError, RetryPolicy, TransportError)

#: The bomb: this many bytes of JSON whitespace after an opening, gzip-compressed to about 1 MB.
BOMB_INFLATED_BYTES = 1 << 30
#: The answer streamed without a Content-Length (and the one whose Content-Length says so).
LARGE_ANSWER_BYTES = 400_000_000
#: The stated bound on the client's peak RSS growth over one call that meets a bomb or a huge
#: answer: the cap it holds at most, one decompression step, and 48 MiB for the interpreter's
#: own churn (unbounded, the bomb cost 5 GiB and the 400 MB answer 2 GiB).
RSS_BOUND_BYTES = espn_client.DEFAULT_MAX_ANSWER_BYTES + (1 << 20) + (48 << 20)
#: The deadline of the slow cases, and the slack a loaded 2-core machine gets past it.
DEADLINE_S = 3.0
SLACK_S = 10.0
#: The trickle: one byte every TRICKLE_GAP_S of a body of TRICKLE_BYTES (80 s in all).
TRICKLE_GAP_S = 2.0
TRICKLE_BYTES = 40
#: What the slow cases leave the client's own per-read timeout at: far longer than the deadline.
READ_TIMEOUT_S = HTTP_TIMEOUT_S
#: Seconds a subprocess measuring memory may take (its call ends in well under one).
SUBPROCESS_TIMEOUT_S = 120

SEARCH_ANSWER = {"query": "q", "results": [{"id": "d1", "score": 1.0, "cls_score": 1.0, "bow_score": 1.0}],
                 "stats": {"stage_ms": {"total": 1.0}, "queue_ms": 0.0, "batch_size": 1, "hit_rate": 1.0,
                           "bytes_read": 0, "ios": 0, "prefetched": 0, "missed": 0}}
OK_BODY = json.dumps(SEARCH_ANSWER).encode()
DEEP = 100_000


def _gzip(chunks: Iterator[bytes], wbits: int = zlib.MAX_WBITS | 16) -> bytes:
    compressor = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return b"".join([compressor.compress(chunk) for chunk in chunks] + [compressor.flush()])


def _bomb() -> bytes:
    spaces = b" " * (1 << 20)
    return _gzip(iter([b'{"query": "q", "results": [', *[spaces] * (BOMB_INFLATED_BYTES >> 20)]))


class Hostile(http.server.BaseHTTPRequestHandler):
    """Answers by the first segment of the path; each answer is a real HTTP/1.1 exchange."""

    protocol_version = "HTTP/1.1"
    bomb = b""

    def _head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _whole(self, status: int, body: bytes, content_type: str = "application/json", **headers: str) -> None:
        self._head(status, {"Content-Type": content_type, "Content-Length": str(len(body)), **headers})
        self.wfile.write(body)

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        case = self.path.strip("/").split("/")[0]
        try:
            getattr(self, "case_" + case.replace("-", "_"))()
        except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: what it should do
            pass

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass

    # -- what a sound server sends, compressed three ways --------------------------------------

    def case_ok(self) -> None:
        self._whole(200, OK_BODY)

    def case_gzip(self) -> None:
        self._whole(200, _gzip(iter([OK_BODY])), **{"Content-Encoding": "gzip"})

    def case_deflate(self) -> None:
        self._whole(200, _gzip(iter([OK_BODY]), zlib.MAX_WBITS), **{"Content-Encoding": "deflate"})

    def case_bare_deflate(self) -> None:
        self._whole(200, _gzip(iter([OK_BODY]), -zlib.MAX_WBITS), **{"Content-Encoding": "deflate"})

    # -- too large -------------------------------------------------------------------------------

    def case_bomb(self) -> None:
        self._whole(200, self.bomb, **{"Content-Encoding": "gzip"})

    def case_large(self) -> None:
        """400 MB, chunked (no Content-Length to refuse it by), until the client hangs up."""
        self._head(200, {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        piece = b" " * (1 << 20)
        for _ in range(LARGE_ANSWER_BYTES // len(piece)):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")

    def case_declared(self) -> None:
        """A Content-Length of 400 MB; the body comes only if the client reads it."""
        self._head(200, {"Content-Type": "application/json", "Content-Length": str(LARGE_ANSWER_BYTES)})
        piece = b" " * (1 << 20)
        for _ in range(LARGE_ANSWER_BYTES // len(piece)):
            self.wfile.write(piece)

    def case_big_error(self) -> None:
        page = b"<html><body>" + b"<p>upstream failed</p>" * 500_000 + b"</body></html>"  # 11 MB
        self._whole(500, page, "text/html")

    # -- too slow --------------------------------------------------------------------------------

    def case_trickle(self) -> None:
        self._head(200, {"Content-Type": "application/json", "Content-Length": str(TRICKLE_BYTES)})
        for byte in b'{"query": "trickled' + b" " * TRICKLE_BYTES:
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            time.sleep(TRICKLE_GAP_S)  # the server's pace is what is tested: not synchronisation

    def case_unavailable(self) -> None:
        self._whole(503, b'{"error": "overloaded", "message": "try later"}', **{"Retry-After": "1"})

    def case_stall(self) -> None:
        time.sleep(READ_TIMEOUT_S)  # headers that never come, within the client's per-read timeout

    # -- the wrong thing -------------------------------------------------------------------------

    def case_html(self) -> None:
        self._whole(200, b"<!DOCTYPE html><html><head><title>Sign in</title></head><body>portal</body></html>",
                    "text/html")

    def case_shape(self) -> None:
        self._whole(200, json.dumps({"query": 5, "results": "none"}).encode())

    def case_deep(self) -> None:
        self._whole(200, b"[" * DEEP + b"]" * DEEP)

    def case_deep_error(self) -> None:
        self._whole(500, b'{"error": ' + b"[" * DEEP + b"]" * DEEP + b"}")

    def case_html_error(self) -> None:
        self._whole(502, b"<html><body><h1>502 Bad Gateway</h1></body></html>", "text/html")

    def case_cut(self) -> None:
        self._head(200, {"Content-Type": "application/json", "Content-Length": "5000"})
        self.wfile.write(b'{"query": "cut short", "results": [')
        self.wfile.flush()
        self.close_connection = True

    def case_brotli(self) -> None:
        self._whole(200, b"\x1b\x00\x00", **{"Content-Encoding": "br"})

    def case_bad_gzip(self) -> None:
        self._whole(200, b"this is not gzip at all", **{"Content-Encoding": "gzip"})


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):  # a client hanging up: expected
            super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def hostile() -> Iterator[str]:
    Hostile.bomb = _bomb()
    assert len(Hostile.bomb) < 2 << 20  # about 1 MB on the wire
    httpd = _Server(("127.0.0.1", 0), Hostile)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _search(url: str, mode: str, **options: Any) -> Any:
    """One search through the sync or the async client (no retries: each case is one answer)."""
    options = {"retry": RetryPolicy(attempts=1), "timeout": READ_TIMEOUT_S, **options}
    if mode == "sync":
        with Client(url, **options) as espn:
            return espn.search("q")

    async def run() -> Any:
        async with AsyncClient(url, **options) as espn:
            return await espn.search("q")

    return asyncio.run(run())


def _raises(kind: type[BaseException], call: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    with pytest.raises(kind) as caught:
        call()
    return caught.value, time.monotonic() - started


MODES = ["sync", "async"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["gzip", "deflate", "bare-deflate"])
def test_compressed_answers_are_read(hostile: str, case: str, mode: str) -> None:
    assert _search(f"{hostile}/{case}", mode).model_dump(exclude_unset=True) == SEARCH_ANSWER


# -- size ---------------------------------------------------------------------------------------

_MEASURE = """
import asyncio, json, resource, sys, time
import espn_client

url, mode = sys.argv[1], sys.argv[2]
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

async def search_async(where):
    async with espn_client.AsyncClient(where, retry=espn_client.RetryPolicy(attempts=1)) as espn:
        return await espn.search("q")

def search(where):
    if mode == "async":
        return asyncio.run(search_async(where))
    with espn_client.Client(where, retry=espn_client.RetryPolicy(attempts=1)) as espn:
        return espn.search("q")

search(url + "/ok")  # every module and code path loaded before the measure starts
before, started = peak(), time.monotonic()
try:
    search(url + "/" + sys.argv[3])
    outcome = {"error": None}
except espn_client.EspnError as error:
    outcome = {"error": type(error).__name__, "status": error.status_code, "excerpt": error.excerpt,
               "message": str(error)}
outcome.update(growth=peak() - before, seconds=time.monotonic() - started)
print(json.dumps(outcome))
"""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["bomb", "large", "declared"])
def test_huge_answers_stop_at_the_cap_within_bounded_memory(hostile: str, case: str, mode: str) -> None:
    done = subprocess.run([sys.executable, "-c", _MEASURE, hostile, mode, case], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout)
    assert outcome["error"] == "ResponseTooLargeError", outcome
    assert outcome["status"] == 200 and "max_answer_bytes" in outcome["message"], outcome
    assert outcome["growth"] < RSS_BOUND_BYTES, (f"peak RSS grew {outcome['growth'] / 2**20:.0f} MiB, over the bound "
                                                 f"of {RSS_BOUND_BYTES / 2**20:.0f} MiB")
    if case == "declared":  # refused by its Content-Length, before any of the body
        assert outcome["growth"] < 16 << 20 and outcome["excerpt"] == ""
    if case == "bomb":
        assert outcome["excerpt"].startswith('{"query": "q", "results": [')


@pytest.mark.parametrize("mode", MODES)
def test_a_small_cap_is_kept_and_an_error_body_is_read_only_so_far(hostile: str, mode: str) -> None:
    error, _ = _raises(ResponseTooLargeError, lambda: _search(f"{hostile}/ok", mode, max_answer_bytes=100))
    assert error.status_code == 200 and error.excerpt == ""  # refused by Content-Length
    error, _ = _raises(ResponseTooLargeError, lambda: _search(f"{hostile}/gzip", mode, max_answer_bytes=100))
    assert error.excerpt == OK_BODY[:100].decode()
    # 11 MB of HTML with a 500: an ApiError of its status, its first MiB read, the rest left unread.
    error, _ = _raises(espn_client.ApiError, lambda: _search(f"{hostile}/big-error", mode))
    assert (error.status_code, error.code) == (500, "http_500") and error.excerpt.startswith("<html><body><p>upstream")


# -- time ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_a_trickled_body_ends_at_the_deadline(hostile: str, mode: str) -> None:
    error, took = _raises(DeadlineExceededError, lambda: _search(f"{hostile}/trickle", mode, deadline_s=DEADLINE_S))
    assert DEADLINE_S - 0.1 <= took < DEADLINE_S + SLACK_S, took
    assert error.status_code == 200 and error.excerpt and '{"query": "trickled'.startswith(error.excerpt), error
    assert isinstance(error, RequestTimeoutError)  # a caller catching timeouts catches it too


@pytest.mark.parametrize("mode", MODES)
def test_headers_that_never_come_end_at_the_deadline_not_the_read_timeout(hostile: str, mode: str) -> None:
    error, took = _raises(RequestTimeoutError, lambda: _search(f"{hostile}/stall", mode, deadline_s=DEADLINE_S))
    assert DEADLINE_S - 0.1 <= took < DEADLINE_S + SLACK_S, took
    assert error.status_code is None and error.excerpt == ""


@pytest.mark.parametrize("mode", MODES)
def test_retries_stop_at_the_deadline(hostile: str, mode: str) -> None:
    """A 503 retried after Retry-After: 1 s, within a deadline of 2.5 s: two or three tries, then
    the server's error (a wait that would pass the deadline is not waited for)."""
    error, took = _raises(espn_client.UnavailableError, lambda: _search(
        f"{hostile}/unavailable", mode, deadline_s=2.5, retry=RetryPolicy(attempts=10)))
    assert took < 2.5 + SLACK_S and error.retry_after_s == 1.0


# -- shape --------------------------------------------------------------------------------------

GARBAGE = {
    # case: (the error, its status, the start of its excerpt, words of its message)
    "html": (MalformedResponseError, 200, "<!DOCTYPE html><html>", "Invalid JSON"),
    "shape": (MalformedResponseError, 200, '{"query": 5, "results": "none"}', "not a SearchResponse: 3 error(s)"),
    "deep": (MalformedResponseError, 200, "[[[[", "recursion limit"),
    "brotli": (MalformedResponseError, 200, "", "content encoding 'br'"),
    "bad-gzip": (MalformedResponseError, 200, "", "not valid gzip"),
    "cut": (TransportError, 200, '{"query": "cut short"', "broken off after 35 bytes"),
    "deep-error": (espn_client.ApiError, 500, '{"error": [[[[', "http_500"),
    "html-error": (espn_client.ApiError, 502, "<html><body><h1>502 Bad Gateway", "http_502"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(GARBAGE))
def test_garbage_is_an_espn_client_error_with_status_and_excerpt(hostile: str, case: str, mode: str) -> None:
    kind, status, start, words = GARBAGE[case]
    error, took = _raises(espn_client.EspnError, lambda: _search(f"{hostile}/{case}", mode))
    assert type(error) is kind or (kind is espn_client.ApiError and isinstance(error, kind)), repr(error)
    assert error.status_code == status and error.excerpt.startswith(start), (error.status_code, error.excerpt)
    assert len(error.excerpt) <= 203 and words in str(error), str(error)
    assert error.method == "POST" and error.url.endswith(f"/{case}/v1/search")
    assert took < SLACK_S


def test_other_answers_are_checked_too(hostile: str) -> None:
    """Not only search: every route's answer goes through the same reader and the same checks."""
    with Client(f"{hostile}/html", retry=RetryPolicy(attempts=1), timeout=READ_TIMEOUT_S) as espn:
        for call in (espn.health, espn.ready, espn.limits, espn.list_indexes, lambda: espn.get_document("d")):
            with pytest.raises(MalformedResponseError):
                call()
    with Client(f"{hostile}/deep", retry=RetryPolicy(attempts=1), timeout=READ_TIMEOUT_S) as espn:
        with pytest.raises(MalformedResponseError, match="OpenAPI"):
            espn.limits()
    with Client(f"{hostile}/bomb", retry=RetryPolicy(attempts=1), max_answer_bytes=1 << 20,
                timeout=READ_TIMEOUT_S) as espn:
        for call in (espn.metrics, lambda: espn.get_page_image("d")):
            with pytest.raises(ResponseTooLargeError):
                call()


def test_limits_are_checked_when_the_client_is_made() -> None:
    for options in ({"deadline_s": 0}, {"deadline_s": -1.0}, {"max_answer_bytes": 0}, {"concurrency": 0}):
        with pytest.raises(ValueError, match=next(iter(options))):
            Client("http://127.0.0.1:9", **options)
    with contextlib.closing(Client("http://127.0.0.1:9", deadline_s=None, timeout=READ_TIMEOUT_S)) as unbounded:
        assert unbounded.deadline_s is None
