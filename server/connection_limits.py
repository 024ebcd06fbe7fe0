"""How many connections a worker holds open, derived from its open-file limit (`ulimit -n`):
what server.connections enforces and the settings check."""

from __future__ import annotations

import dataclasses
import resource
from typing import Optional

__all__ = ["ConnectionLimits", "RESERVED_DESCRIPTORS", "descriptor_limit", "listen_backlog", "default_max_connections",
           "check_connections_below_limit", "connection_limits"]

#: Descriptors kept for everything but client connections (the index's files, the metrics
#: directory, pipes, io_uring), at least; a quarter of the limit when that is more.
RESERVED_DESCRIPTORS = 64
_MOST_CONNECTIONS = 65_536  # past this a worker's memory, not its descriptors, is the limit


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """What server.connections enforces per process, and the listen backlog that goes with it."""

    max_connections: int
    header_timeout_s: float
    backlog: int


def descriptor_limit() -> int:
    """This process's soft RLIMIT_NOFILE (`ulimit -n`)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _MOST_CONNECTIONS * 2 if soft == resource.RLIM_INFINITY else int(soft)


def listen_backlog(limit: Optional[int] = None) -> int:
    """The listen backlog: asyncio accepts up to this many sockets at a time before the
    connection cap sees any of them, so it is small next to the descriptor limit."""
    limit = descriptor_limit() if limit is None else limit
    return max(8, min(limit // 32, 2048))


def default_max_connections(limit: Optional[int] = None) -> int:
    """Open connections a worker allows by default: the descriptor limit less what is reserved for
    the index and less four accept bursts (sockets accepted, or closed, but not yet seen by the cap)."""
    limit = descriptor_limit() if limit is None else limit
    return max(1, min(limit - max(RESERVED_DESCRIPTORS, limit // 4) - 4 * listen_backlog(limit), _MOST_CONNECTIONS))


def check_connections_below_limit(max_connections: Optional[int]) -> None:
    limit = descriptor_limit()
    most = limit - RESERVED_DESCRIPTORS - 4 * listen_backlog(limit)
    if max_connections is not None and max_connections > most:
        raise ValueError(f"max connections {max_connections} must stay below the open-file limit {limit} "
                         f"(`ulimit -n`) less {limit - most} descriptors (index files, accept bursts): at most "
                         f"{most}, or descriptors run out before it applies")


def connection_limits(max_connections: Optional[int], header_timeout_s: float) -> ConnectionLimits:
    return ConnectionLimits(max_connections or default_max_connections(), header_timeout_s, listen_backlog())
