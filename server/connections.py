"""Connection limits: a worker's open connections stay below its open-file limit.

uvicorn accepts every connection and waits for its request as long as the client likes, so
sockets that never send a byte pile up until `accept()` fails with EMFILE; asyncio then logs
"socket.accept() out of system resource" up to a backlog's worth of times per second and the
worker stops answering. `GuardedH11Protocol` (uvicorn's h11 protocol, selected with
`http=GuardedH11Protocol`) adds, per worker process:

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
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from typing import Any, Optional

from uvicorn.protocols.http.h11_impl import H11Protocol

from .settings import ConnectionLimits, default_max_connections, listen_backlog

__all__ = ["GuardedH11Protocol", "install"]

logger = logging.getLogger(__name__)

_REPORT_EVERY_S = 60.0


class _Guard:
    """The connections of one process: which wait for a request (oldest first), and counters."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open: set[GuardedH11Protocol] = set()
        self.waiting: collections.OrderedDict[GuardedH11Protocol, asyncio.TimerHandle] = collections.OrderedDict()
        self.counts = {"closed_idle_for_a_new_one": 0, "refused_503": 0, "header_timeouts": 0}
        self.reported_at = float("-inf")  # the first event is reported at once

    def opened(self, connection: "GuardedH11Protocol") -> bool:
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

    def wait_for_request(self, connection: "GuardedH11Protocol") -> None:
        if connection in self.open and connection not in self.waiting:
            self.waiting[connection] = connection.loop.call_later(
                self.limits.header_timeout_s, self._timed_out, connection)

    def request_started(self, connection: "GuardedH11Protocol") -> None:
        timer = self.waiting.pop(connection, None)
        if timer is not None:
            timer.cancel()

    def close(self, connection: "GuardedH11Protocol") -> None:
        self.forget(connection)
        if not connection.transport.is_closing():
            connection.transport.close()

    def forget(self, connection: "GuardedH11Protocol") -> None:
        self.request_started(connection)
        self.open.discard(connection)

    def _timed_out(self, connection: "GuardedH11Protocol") -> None:
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


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under the process's connection limits (see the module doc)."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if not _current().opened(self):
            transport.write(_REFUSED)
            transport.close()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        _current().forget(self)
        super().connection_lost(exc)

    def _track(self) -> None:
        guard = _current()
        if self.cycle is not None and not self.cycle.response_complete:
            guard.request_started(self)
        elif not self.transport.is_closing():
            guard.wait_for_request(self)
