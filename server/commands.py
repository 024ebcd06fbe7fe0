"""`espn serve INDEX [--index NAME=PATH ...]` and `espn route`: flags -> ESPN_* environment -> settings -> uvicorn workers.

Their parsers are server.cli's; this module loads only when one of them runs. The settings
are validated and printed once, here; uvicorn then starts `espn_server.app:create_app` as
a factory in each worker, and each worker rebuilds the same settings from the environment
this function exported. What would make every worker fail (a damaged index, a port in
use) is one line, `espn serve: error: ...`, and exit 1, before any worker starts.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import gc
import ipaddress
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional

from pydantic import ValidationError

from espn.errors import EspnError
from espn.engine import startup

from . import connections
from .auth import key_digest
from .logs import logging_config
from .metrics_dir import MetricsDir, remove_stale as remove_stale_metrics_dirs
from .router_settings import RouterSettings
from .settings import ENV_PREFIX, ROUTER_ENV_PREFIX, ServerSettings, settings_error_line

__all__ = ["run_serve", "run_route", "COMMANDS", "is_loopback", "port_problem", "APP_FACTORY"]

logger = logging.getLogger(__name__)

# prometheus_client picks its multiprocess value class when first imported, so this is
# set before anything imports it (server.metrics names the same variable).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# The app factory, named by whatever name this package is installed under (espn_server).
APP_FACTORY = f"{__package__}.app:create_app"


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    """ESPN_* variables for the flags given on the command line (each flag's dest is its field)."""
    env: dict[str, str] = {}
    for name in ServerSettings.model_fields:
        value: Any = getattr(args, name, None)
        if value is None:
            continue
        env[ENV_PREFIX + name.upper()] = json.dumps(value) if isinstance(value, list) else str(value)
    return env


def _fork_workers() -> bool:
    """Preload the heavy imports here and have uvicorn fork its workers from this process.

    uvicorn starts workers with `spawn`: each is a fresh interpreter that imports torch
    (~140 MB of private heap) and transformers' model code (~100 MB, it pulls in
    torch._dynamo) on its own. Forked from a parent that imported them once, the
    workers share those pages copy-on-write; gc.freeze() keeps the collector from
    touching (and so copying) them. Only imports happen here: no index, no model, no
    torch op (an initialised OpenMP pool must not be forked), no thread.
    uvicorn has no public switch for this; its spawn context is a module attribute,
    checked here so that another uvicorn version falls back to spawn instead of failing.
    """
    from uvicorn import _subprocess

    if "fork" not in multiprocessing.get_all_start_methods() or not hasattr(_subprocess, "spawn"):
        logger.warning("cannot fork uvicorn workers here; each worker imports torch on its own")
        return False
    startup().preload()  # torch, FAISS, the encoders, transformers' model code
    from . import app  # noqa: F401  fastapi, pydantic, prometheus_client (multiprocess mode by now)

    gc.collect()
    gc.freeze()
    _subprocess.spawn = multiprocessing.get_context("fork")  # type: ignore[assignment]
    return True


def _return_freed_memory() -> None:
    """Make glibc give large freed blocks back to the OS, in this process and the workers it forks.

    A search allocates tens of MB of short-lived tensors per batch. By default glibc
    raises its mmap threshold after such frees and then keeps the memory in per-thread
    arenas, so each worker's private heap grows to its worst batch. A fixed threshold
    (which also turns the dynamic one off) and two arenas keep workers small; this is
    the run-time form of MALLOC_MMAP_THRESHOLD_ and MALLOC_ARENA_MAX.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_mmap_threshold, m_arena_max = -3, -8
    libc.mallopt(m_mmap_threshold, 1 << 20)
    libc.mallopt(m_arena_max, 2)


def _restore_follower() -> Optional[str]:
    """A new follower (--follow, INDEX absent) starts from the newest generation, and so does a new
    writer (--publish, INDEX absent: a standby, or the first writer of a partition a reshard
    made); the error line, or None."""
    index = os.environ.get(f"{ENV_PREFIX}INDEX")
    follow = os.environ.get(f"{ENV_PREFIX}FOLLOW") or os.environ.get(f"{ENV_PREFIX}PUBLISH")
    if follow and index and not Path(index).exists():
        try:
            startup().restore(follow, Path(index))
        except EspnError as error:
            return f"espn serve: error: {error}"
    return None


def _check_before_start(settings: ServerSettings) -> Optional[str]:
    """What would make every worker fail at start-up, as one line (None: nothing)."""
    # A damaged index is one line and exit 1 here, not a traceback from every worker's start-up.
    # What is checked is what the workers will serve: the current generation of a live index.
    # The ports first: a port in use would otherwise show only after every worker has loaded the index.
    problem = port_problem(settings.host, settings.port, "--port (ESPN_PORT)")
    if problem is None and settings.metrics_port is not None:
        problem = port_problem(settings.host, settings.metrics_port, "--metrics-port (ESPN_METRICS_PORT)")
    if problem is not None:
        return f"espn serve: error: {problem}"
    problem = startup().problem(settings.serve_config())  # every index opens lazily in the workers: checked now
    return None if problem is None else f"espn serve: error: {problem}"


def port_problem(host: str, port: int, flag: str) -> Optional[str]:
    """Why uvicorn could not listen on `host`:`port`, in words (None: it can).

    Binds as uvicorn will (every address `host` resolves to, SO_REUSEADDR, so a port left in
    TIME_WAIT by a server just stopped counts as free) and closes at once: a port in use is
    refused here, in a second, not after each worker has loaded the index (exit 3 and a JSON
    log line). Port 0 (any free port) always binds.
    """
    if port == 0:
        return None
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        return f"cannot listen on {host}: {error.strerror}"
    for family, kind, proto, _name, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio's create_server: the IPv6 socket takes IPv6 only
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    return f"port {port} on {host} is in use (another server?); stop it or give another {flag}"
                if error.errno == errno.EACCES:
                    return (f"port {port} on {host}: permission denied (ports below 1024 need privileges); "
                            f"give another {flag}")
                return f"cannot listen on port {port} on {host}: {error.strerror}"
    return None


def _decide_read_only(settings: ServerSettings) -> ServerSettings:
    """Decided once, here, so every worker agrees (and it is logged once)."""
    if settings.follow is not None:  # a follower's index changes only by what it fetches
        settings = settings.model_copy(update={"read_only": True})
    if settings.read_only is None and settings.index is not None:
        reason = startup().read_only_reason(settings.index)
        settings = settings.model_copy(update={"read_only": reason is not None})
        if reason is not None:
            print(json.dumps({"level": "WARNING", "event": "read_only",
                              "message": f"serving read-only: {reason}; writes get 409 (--read-only says so "
                              "explicitly)"}), file=sys.stderr, flush=True)
    return settings


def _prepare_index_root(settings: ServerSettings) -> Optional[str]:
    """The directory indexes are created in: made if missing, and cleared of what killed creations
    and deletions left (here, once, before any worker could be creating one); the error line, or None."""
    root = settings.creation_root()
    if root is None:
        return None
    try:
        removed = startup().clear_root(root)
    except OSError as error:
        return f"espn serve: error: --index-root {root}: {error.strerror or error}"
    if removed:
        print(json.dumps({"event": "removed leftovers of killed index creations and deletions", "root": str(root),
                          "removed": removed}), file=sys.stderr, flush=True)
    return None


def _announce(settings: ServerSettings) -> None:
    """The settings every worker will read, exported and printed once; a warning when unauthenticated."""
    # Normalised values (resolved index path, ...) are what every worker will read.
    os.environ.update(settings.to_env())
    print(json.dumps({"event": "settings", **settings.describe()}), file=sys.stderr, flush=True)
    if not settings.keyed and not is_loopback(settings.host):
        print(json.dumps({"level": "WARNING", "event": "unauthenticated",
                          "message": f"serving on {settings.host} without ESPN_API_KEY: anyone who can reach this "
                          "address can search and read every document; set ESPN_API_KEY (from a secret)"}),
              file=sys.stderr, flush=True)


def run_serve(args: argparse.Namespace) -> int:
    """Validate the settings, print them once, and serve until SIGTERM/SIGINT. Returns an exit code."""
    os.environ.update(_overrides(args))
    problem = _restore_follower()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    try:
        settings = ServerSettings()  # type: ignore[call-arg]  # index comes from ESPN_INDEX
    except ValidationError as error:
        print(settings_error_line("serve", ENV_PREFIX, error), file=sys.stderr)
        return 2
    problem = _check_before_start(settings)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    settings = _decide_read_only(settings)
    problem = _prepare_index_root(settings)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    _announce(settings)
    multiproc_dir: Optional[MetricsDir] = None
    if (settings.workers > 1 or settings.metrics_port is not None) and MULTIPROC_ENV not in os.environ:
        # Each worker writes its metric samples here; /metrics aggregates them all. What a
        # server killed with SIGKILL left in the temporary directory goes first.
        removed = remove_stale_metrics_dirs()
        if removed:
            print(json.dumps({"event": "stale metric directories removed", "paths": [str(p) for p in removed]}),
                  file=sys.stderr, flush=True)
        multiproc_dir = MetricsDir()
        os.environ[MULTIPROC_ENV] = str(multiproc_dir.path)
    try:
        return _serve(settings)
    finally:
        if multiproc_dir is not None:
            os.environ.pop(MULTIPROC_ENV, None)
            multiproc_dir.close()


def _serve(settings: ServerSettings) -> int:
    """uvicorn with the app factory in each worker, until it drains; its exit code."""
    # Imported after validation: a bad flag fails without importing the server stack (and
    # prometheus_client only once PROMETHEUS_MULTIPROC_DIR is set).
    import uvicorn

    _return_freed_memory()
    # uvicorn re-raises the SIGTERM it drained on, so the process would end "killed by
    # SIGTERM" (143) after a clean drain; this handler turns that last raise into exit 0.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    metrics_server = _start_metrics_server(settings) if settings.metrics_port is not None else None
    try:
        if settings.workers > 1 and settings.preload:
            _fork_workers()
        uvicorn.run(
            APP_FACTORY,
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            log_config=logging_config(settings.log_level),
            log_level=settings.log_level,
            access_log=False,  # server.middleware.AccessMiddleware logs each request once
            server_header=False,
            http=connections.guarded_protocol(),  # the connection cap and header timeout (server.connections)
            backlog=settings.connection_limits().backlog,
            timeout_keep_alive=settings.keep_alive_s,
            timeout_graceful_shutdown=settings.graceful_timeout_s,
            # Loading torch and the index can take a while on a busy machine.
            timeout_worker_healthcheck=60,
        )
    except SystemExit as exit_:  # uvicorn exits 3 when the app fails to start (bad index, ...)
        return exit_.code if isinstance(exit_.code, int) else 1
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
    return 0


def run_route(args: argparse.Namespace) -> int:
    """`espn route`: validate the settings and serve the router until SIGTERM/SIGINT. Returns an exit code."""
    given = {name: getattr(args, name, None) for name in RouterSettings.model_fields}
    try:
        settings = RouterSettings(**{name: value for name, value in given.items() if value is not None})
    except ValidationError as error:
        print(settings_error_line("route", ROUTER_ENV_PREFIX, error), file=sys.stderr)
        return 2
    print(f"espn route: {len(settings.shards)} shard(s), timeout {settings.timeout_ms:g} ms, "
          f"listening on {settings.host}:{settings.port}", file=sys.stderr)
    if not settings.keyed and not is_loopback(settings.host):
        print(f"espn route: warning: listening on {settings.host} without ESPN_API_KEY: anyone who can reach it can "
              "search every partition", file=sys.stderr)
    # Imported here: the router needs httpx (its client), which no other command needs
    # (tests/test_packaging.py runs the rest of the command line without it).
    import uvicorn

    from .router import build_router_app  # httpx: only `espn route` needs it (see above)

    limits = settings.connection_limits()
    connections.install(limits)
    uvicorn.run(build_router_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                log_config=logging_config(settings.log_level), access_log=False, server_header=False,
                http=connections.guarded_protocol(), backlog=limits.backlog, timeout_keep_alive=settings.keep_alive_s,
                timeout_graceful_shutdown=30)
    return 0


def _exit_cleanly(signum: int, frame: Optional[types.FrameType]) -> None:
    raise SystemExit(0)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume reachable from elsewhere
        return False


def _start_metrics_server(settings: ServerSettings) -> Any:
    """/metrics of every worker on its own port, served by this (parent) process.

    The workers write their samples to PROMETHEUS_MULTIPROC_DIR; a collector over that
    directory answers here, so the API port (which may face users) has no /metrics.
    """
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    assert settings.metrics_port is not None
    server, _thread = start_http_server(settings.metrics_port, addr=settings.host, registry=registry)
    print(json.dumps({"event": "metrics", "url": f"http://{settings.host}:{settings.metrics_port}/metrics"}),
          file=sys.stderr, flush=True)
    return server


def run_key_hash(args: argparse.Namespace) -> int:
    """`espn key-hash`: the digest of the key on stdin (one line; surrounding whitespace dropped)."""
    key = sys.stdin.readline().strip()
    if not key:
        print("espn key-hash: error: no key on stdin (e.g. `openssl rand -hex 32 | tee key | espn key-hash`)",
              file=sys.stderr)
        return 2
    print(key_digest(key))
    return 0


#: `espn serve`, `espn route` and `espn key-hash` by name (server.cli.run_command dispatches on it).
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"serve": run_serve, "route": run_route,
                                                            "key-hash": run_key_hash}
