"""Connection limits: a worker's open connections stay below its open-file limit.

uvicorn accepts every connection and waits for its request as long as the client likes, so
sockets that never send a byte pile up until `accept()` fails with EMFILE; asyncio then logs
"socket.accept() out of system resource" up to a backlog's worth of times per second and the
worker stops answering. `guarded_protocol()` (uvicorn's httptools protocol, or its h11
protocol where httptools cannot be imported; passed as uvicorn's `http=`) adds, per worker
process:

- a cap on open connections (`max_connections`, by default derived from RLIMIT_NOFILE):
  a connection beyond it closes the oldest connection that is waiting for a request (one that
  sent nothing yet, or a keep-alive between requests), or, when every connection is busy with
  a request, is answered 503 and closed at once, so descriptors never run out;
- a header timeout: a connection must send a whole request head within `header_timeout_s` of
  opening (or of its previous answer), else it is closed;
- one summary log line per interval for all of the above, never one per connection.

A body that trickles is the body limit's business (server.middleware.BodyLimitMiddleware,
408 past `body_timeout_s`). The limits are installed per process by `install`, which the app
factory (or the router) calls in each worker before it serves.

httptools parses in C: on this project's 2-vCPU VM a request to an app that does nothing took
0.53 ms against h11's 1.41 ms (`benchmarks.bench_http_floor`: one keep-alive client, median of
5 rounds' p50). h11 stays the pure-Python fallback.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from typing import Any, Optional

from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # a C extension: where its wheel is missing and it cannot build, h11 serves
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools is a dependency; the fallback is for odd platforms
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

from .connection_limits import ConnectionLimits, default_max_connections, listen_backlog

__all__ = ["GuardedH11Protocol", "GuardedHttpToolsProtocol", "guarded_protocol", "install"]

logger = logging.getLogger(__name__)

_REPORT_EVERY_S = 60.0


class _Guard:
    """The connections of one process: which wait for a request (oldest first), and counters."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open: set[_Guarded] = set()
        self.waiting: collections.OrderedDict[_Guarded, asyncio.TimerHandle] = collections.OrderedDict()
        self.counts = {"closed_idle_for_a_new_one": 0, "refused_503": 0, "header_timeouts": 0}
        self.reported_at = float("-inf")  # the first event is reported at once

    def opened(self, connection: "_Guarded") -> bool:
        """Admit `connection` (closing the oldest waiting one if at the cap); False: refused."""
        if len(self.open) >= self.limits.max_connections:
            if not self.waiting:
                self._count("refused_503")
                return False
            oldest = next(iter(self.waiting))
            self._count("closed_idle_for_a_new_one")
            self.close(oldest)
        self.open.add(connection)
        self.wait_for_request(connection)
        return True

    def wait_for_request(self, connection: "_Guarded") -> None:
        if connection in self.open and connection not in self.waiting:
            self.waiting[connection] = connection.loop.call_later(
                self.limits.header_timeout_s, self._timed_out, connection)

    def request_started(self, connection: "_Guarded") -> None:
        timer = self.waiting.pop(connection, None)
        if timer is not None:
            timer.cancel()

    def close(self, connection: "_Guarded") -> None:
        self.forget(connection)
        if not connection.transport.is_closing():
            connection.transport.close()

    def forget(self, connection: "_Guarded") -> None:
        self.request_started(connection)
        self.open.discard(connection)

    def _timed_out(self, connection: "_Guarded") -> None:
        if connection in self.waiting:
            self._count("header_timeouts")
            self.close(connection)

    def _count(self, what: str) -> None:
        self.counts[what] += 1
        now = time.monotonic()
        if now - self.reported_at >= _REPORT_EVERY_S:
            logger.warning("connection limits at work (counts since the last such line): %s; %d open, at most %d, "
                           "header timeout %g s", json.dumps(self.counts), len(self.open),
                           self.limits.max_connections, self.limits.header_timeout_s)
            self.counts = dict.fromkeys(self.counts, 0)
            self.reported_at = now


_guard: Optional[_Guard] = None


def install(limits: ConnectionLimits) -> None:
    """The limits of this process's connections (call before serving; again to change them)."""
    global _guard
    _guard = _Guard(limits)


def _current() -> _Guard:
    if _guard is None:  # used without install(): the defaults
        install(ConnectionLimits(default_max_connections(), 10.0, listen_backlog()))
    assert _guard is not None
    return _guard


_REFUSED_BODY = json.dumps({"error": "overloaded", "message": "too many open connections to this server; retry"})
_REFUSED = ("HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"content-length: {len(_REFUSED_BODY)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
            f"{_REFUSED_BODY}").encode()


class _Guarded:
    """The connection guard of either uvicorn HTTP protocol (see the module doc); mixed in before it."""

    transport: Any
    cycle: Any
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        if not _current().opened(self):
            transport.write(_REFUSED)
            transport.close()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        super().data_received(data)  # type: ignore[misc]
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._track()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        _current().forget(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def _track(self) -> None:
        guard = _current()
        if self.cycle is not None and not self.cycle.response_complete:
            guard.request_started(self)
        elif not self.transport.is_closing():
            guard.wait_for_request(self)


class GuardedH11Protocol(_Guarded, H11Protocol):
    """uvicorn's h11 protocol (pure Python) under the process's connection limits."""


GuardedHttpToolsProtocol: Optional[type] = None
if HttpToolsProtocol is not None:
    class _GuardedHttpTools(_Guarded, HttpToolsProtocol):
        """uvicorn's httptools protocol (C parser) under the process's connection limits."""

    GuardedHttpToolsProtocol = _GuardedHttpTools


def guarded_protocol() -> type:
    """The protocol class for uvicorn's `http=`: httptools where it imports, else h11."""
    return GuardedHttpToolsProtocol or GuardedH11Protocol
