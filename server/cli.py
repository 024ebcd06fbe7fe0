"""`espn serve INDEX`: flags -> ESPN_* environment -> ServerSettings -> uvicorn workers.

`register` adds `serve` and `route` to the `espn` command (entry point `espn.commands`).

Each flag overrides its environment variable (`--port` over `ESPN_PORT`), which overrides
the default. The API key is read only from `ESPN_API_KEY`, never from a flag, so it does
not show in `ps`. The settings are validated and printed once, here; uvicorn then starts
`espn_server.app:create_app` as a factory in each worker, and each worker rebuilds the same
settings from the environment this function exported.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import ipaddress
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import types
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from .settings import ENV_PREFIX, READER_NAMES, ServerSettings

__all__ = ["add_serve_arguments", "run_serve", "register"]

logger = logging.getLogger(__name__)

# prometheus_client picks its multiprocess value class when first imported, so this is
# set before anything imports it (server.metrics names the same variable).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Flag destination -> ServerSettings field, for the flags that map one to one.
_FLAG_FIELDS = {
    "index": "index",
    "host": "host",
    "port": "port",
    "workers": "workers",
    "reader": "reader",
    "device": "device",
    "batch_wait_ms": "batch_wait_ms",
    "max_batch_size": "max_batch_size",
    "search_threads": "search_threads",
    "torch_threads": "torch_threads",
    "max_body_bytes": "max_body_bytes",
    "max_batch_queries": "max_batch_queries",
    "graceful_timeout": "graceful_timeout_s",
    "log_level": "log_level",
    "io_engine": "io_engine",
    "io_depth": "io_depth",
    "max_extent_bytes": "max_extent_bytes",
    "max_request_work": "max_request_work",
    "max_response_bytes": "max_response_bytes",
    "metrics_port": "metrics_port",
    "write_wait": "write_wait_s",
    "write_nice": "write_nice",
    "write_queue": "write_queue",
    "compact_max_segments": "compact_max_segments",
    "compact_merge_factor": "compact_merge_factor",
    "compact_base_ratio": "compact_base_ratio",
    "compact_deleted_fraction": "compact_deleted_fraction",
    "max_metadata_fields": "max_metadata_fields",
    "max_metadata_bytes": "max_metadata_bytes",
    "max_index_fields": "max_index_fields",
}

# The app factory, named by whatever name this package is installed under (espn_server).
APP_FACTORY = f"{__package__}.app:create_app"


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add `serve` and `route` to the `espn` subcommands."""
    p = sub.add_parser("serve", help="serve an index over HTTP (FastAPI under uvicorn)")
    add_serve_arguments(p)
    p.set_defaults(handler=run_serve)
    p = sub.add_parser("route", help="fan queries out to index partition servers and merge their top-k")
    add_route_arguments(p)
    p.set_defaults(handler=_run_route)


def _run_route(args: argparse.Namespace) -> int:
    # The router (and httpx, its client) is imported only by the command that uses it, so every
    # other subcommand, and `espn --help`, work wherever httpx is missing.
    from .router import run_route

    return run_route(args)


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `espn route`; each defaults to its ESPN_ROUTER_* variable."""
    parser.add_argument("--shards", metavar="URL,URL",
                        help="base URL of each partition's server, comma-separated (ESPN_ROUTER_SHARDS)")
    parser.add_argument("--timeout-ms", type=float, metavar="MS",
                        help="per-shard time limit; a shard slower than this is left out and the answer "
                             "marked partial (ESPN_ROUTER_TIMEOUT_MS, default 2000)")
    parser.add_argument("--host", help="interface to bind (ESPN_ROUTER_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="TCP port (ESPN_ROUTER_PORT, default 8080)")
    parser.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"],
                        help="(ESPN_ROUTER_LOG_LEVEL, default info)")


def _reader_choices() -> list[str]:
    try:  # the library's registry names the readers; fall back if it cannot be imported
        from espn.store import READERS

        return ["auto", *READERS]
    except ImportError:
        return ["auto", *READER_NAMES]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `espn serve`; every one but INDEX defaults to its ESPN_* variable."""
    parser.add_argument("index", type=Path, metavar="INDEX", help="index directory built by `espn index`")
    net = parser.add_argument_group("listening")
    net.add_argument("--host", help="interface to bind (ESPN_HOST, default 127.0.0.1)")
    net.add_argument("--port", type=int, help="TCP port, 0 for any free one (ESPN_PORT, default 8000)")
    net.add_argument("--workers", type=int, help="worker processes sharing the mmapped index (ESPN_WORKERS, default 1)")
    net.add_argument("--no-preload", action="store_true",
                     help="start workers as fresh interpreters (spawn) instead of forking a preloaded parent")
    net.add_argument("--graceful-timeout", type=int, metavar="S",
                     help="seconds in-flight requests get after SIGTERM (ESPN_GRACEFUL_TIMEOUT_S, default 30)")
    search = parser.add_argument_group("search")
    search.add_argument("--reader", choices=_reader_choices(),
                        help="embedding reader (ESPN_READER, default: the library's choice for this machine)")
    search.add_argument("--device", help="torch device for re-ranking (ESPN_DEVICE)")
    search.add_argument("--batch-wait-ms", type=float, metavar="MS",
                        help="how long a query waits for others to batch with (ESPN_BATCH_WAIT_MS, default 2)")
    search.add_argument("--max-batch-size", type=int, metavar="N",
                        help="most queries per search call (ESPN_MAX_BATCH_SIZE, default 32)")
    search.add_argument("--search-threads", type=int, metavar="N",
                        help="search calls in flight per worker (ESPN_SEARCH_THREADS, default 1)")
    search.add_argument("--torch-threads", type=int, metavar="N",
                        help="torch threads per worker (ESPN_TORCH_THREADS, default cores / workers)")
    io = parser.add_argument_group("reader I/O (posix reader only)")
    io.add_argument("--io-engine", choices=["auto", "io_uring", "aio", "threads"],
                    help="read engine (ESPN_IO_ENGINE, default auto: io_uring, then aio, then threads)")
    io.add_argument("--io-depth", type=int, metavar="N", help="extents in flight at once (ESPN_IO_DEPTH, default 64)")
    io.add_argument("--max-extent-bytes", type=int, metavar="N",
                    help="cap on one coalesced read (ESPN_MAX_EXTENT_BYTES, default 1 MiB)")
    io.add_argument("--no-direct", action="store_true", help="buffered reads instead of O_DIRECT (ESPN_DIRECT=false)")
    limits = parser.add_argument_group("requests")
    limits.add_argument("--max-body-bytes", type=int, metavar="B",
                        help="largest request body (ESPN_MAX_BODY_BYTES, default 1 MiB)")
    limits.add_argument("--max-batch-queries", type=int, metavar="N",
                        help="most queries in one /v1/search/batch (ESPN_MAX_BATCH_QUERIES, default 256)")
    limits.add_argument("--cors-origin", action="append", dest="cors_origins", metavar="ORIGIN",
                        help="allow this browser origin; repeatable (ESPN_CORS_ORIGINS, default: CORS off)")
    limits.add_argument("--max-request-work", type=int, metavar="N",
                        help="most queries x max(k, rerank_count, prefetch_k) per request (ESPN_MAX_REQUEST_WORK, "
                        "default 262144)")
    limits.add_argument("--max-response-bytes", type=int, metavar="B",
                        help="largest estimated response (ESPN_MAX_RESPONSE_BYTES, default 16 MiB)")
    writes = parser.add_argument_group("writes (PUT/DELETE /v1/documents, POST /v1/documents/batch)")
    writes.add_argument("--read-only", action="store_true",
                        help="refuse writes with 409 (ESPN_READ_ONLY; default: read-only when the index directory "
                        "is not writable, e.g. mounted read-only)")
    writes.add_argument("--write-wait", type=float, metavar="S",
                        help="how long a write waits for the writer lock before a 503 (ESPN_WRITE_WAIT_S, default 10)")
    writes.add_argument("--write-nice", type=int, metavar="N",
                        help="CPU priority (nice, 0-19) of write encoding and compaction, so searches keep the CPU "
                        "they need (ESPN_WRITE_NICE, default 10)")
    writes.add_argument("--write-queue", type=int, metavar="N",
                        help="documents and deletes queued per worker before writes get 503 (ESPN_WRITE_QUEUE, "
                        "default 10000)")
    writes.add_argument("--compact-max-segments", type=int, metavar="N",
                        help="merge deltas in the background past this many (ESPN_COMPACT_MAX_SEGMENTS, default 8)")
    writes.add_argument("--compact-merge-factor", type=int, metavar="N",
                        help="deltas merged into one at a time (ESPN_COMPACT_MERGE_FACTOR, default 4)")
    writes.add_argument("--compact-base-ratio", type=float, metavar="R",
                        help="rewrite the base once deltas hold this fraction of its documents "
                        "(ESPN_COMPACT_BASE_RATIO, default 0.5)")
    writes.add_argument("--compact-deleted-fraction", type=float, metavar="F",
                        help="... or once this fraction of documents is deleted or replaced "
                        "(ESPN_COMPACT_DELETED_FRACTION, default 0.2)")
    writes.add_argument("--max-metadata-fields", type=int, metavar="N",
                        help="metadata fields per document (ESPN_MAX_METADATA_FIELDS, default 64)")
    writes.add_argument("--max-metadata-bytes", type=int, metavar="B",
                        help="a document's metadata as JSON (ESPN_MAX_METADATA_BYTES, default 16384)")
    writes.add_argument("--max-index-fields", type=int, metavar="N",
                        help="distinct metadata fields per index (ESPN_MAX_INDEX_FIELDS, default 256)")
    ops = parser.add_argument_group("operations")
    ops.add_argument("--metrics-port", type=int, metavar="PORT",
                     help="serve /metrics on this port instead of the API port (ESPN_METRICS_PORT)")
    ops.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"],
                     help="(ESPN_LOG_LEVEL, default info)")
    ops.add_argument("--no-warmup", action="store_true", help="report ready without warming the index (ESPN_WARMUP)")
    parser.epilog = (
        "Set ESPN_API_KEY to require `Authorization: Bearer <key>` on /v1/*. "
        "Every flag can also be given as an ESPN_* environment variable."
    )


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    """ESPN_* variables for the flags given on the command line."""
    env: dict[str, str] = {}
    for dest, field in _FLAG_FIELDS.items():
        value: Any = getattr(args, dest, None)
        if value is not None:
            env[ENV_PREFIX + field.upper()] = str(value)
    if getattr(args, "cors_origins", None):
        env[ENV_PREFIX + "CORS_ORIGINS"] = json.dumps(args.cors_origins)
    if getattr(args, "no_warmup", False):
        env[ENV_PREFIX + "WARMUP"] = "false"
    if getattr(args, "no_preload", False):
        env[ENV_PREFIX + "PRELOAD"] = "false"
    if getattr(args, "no_direct", False):
        env[ENV_PREFIX + "DIRECT"] = "false"
    if getattr(args, "read_only", False):
        env[ENV_PREFIX + "READ_ONLY"] = "true"
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
    import espn.searcher  # noqa: F401  torch, faiss, numpy, the encoders
    import transformers.modeling_utils  # noqa: F401  torch._dynamo & co, imported by every HF model

    from . import app  # noqa: F401  fastapi, pydantic, prometheus_client (multiprocess mode by now)

    gc.collect()
    gc.freeze()
    _subprocess.spawn = multiprocessing.get_context("fork")  # type: ignore[assignment]
    return True


def _print_errors(error: ValidationError) -> None:
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "settings"
        print(f"espn serve: {field} ({ENV_PREFIX}{field.upper()}): {item['msg']}", file=sys.stderr)


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


def run_serve(args: argparse.Namespace) -> int:
    """Validate the settings, print them once, and serve until SIGTERM/SIGINT. Returns an exit code."""
    os.environ.update(_overrides(args))
    try:
        settings = ServerSettings()  # type: ignore[call-arg]  # index comes from ESPN_INDEX
    except ValidationError as error:
        _print_errors(error)
        return 2
    # A damaged index is one line and exit 1 here, not a traceback from every worker's start-up.
    # What is checked is what the workers will serve: the current generation of a live index.
    from espn.errors import EspnError
    from espn.segments import open_view

    try:
        open_view(settings.index, verify="fast").close()
    except (EspnError, ValueError, OSError) as error:
        print(f"espn serve: error: {error}", file=sys.stderr)
        return 1
    if settings.read_only is None:  # decided once, here, so every worker agrees (and it is logged once)
        from espn_indexing.live import read_only_reason

        reason = read_only_reason(settings.index)
        settings = settings.model_copy(update={"read_only": reason is not None})
        if reason is not None:
            print(json.dumps({"level": "WARNING", "event": "read_only",
                              "message": f"serving read-only: {reason}; writes get 409 (--read-only says so "
                              "explicitly)"}), file=sys.stderr, flush=True)
    # Normalised values (resolved index path, ...) are what every worker will read.
    os.environ.update(settings.to_env())
    print(json.dumps({"event": "settings", **settings.describe()}), file=sys.stderr, flush=True)
    if settings.api_key is None and not _is_loopback(settings.host):
        print(json.dumps({"level": "WARNING", "event": "unauthenticated",
                          "message": f"serving on {settings.host} without ESPN_API_KEY: anyone who can reach this "
                          "address can search and read every document; set ESPN_API_KEY (from a secret)"}),
              file=sys.stderr, flush=True)

    multiproc_dir: Optional[str] = None
    if (settings.workers > 1 or settings.metrics_port is not None) and MULTIPROC_ENV not in os.environ:
        # Each worker writes its metric samples here; /metrics aggregates them all.
        multiproc_dir = tempfile.mkdtemp(prefix="espn-metrics-")
        os.environ[MULTIPROC_ENV] = multiproc_dir

    import uvicorn  # after validation: a bad flag fails without importing the server stack

    _return_freed_memory()

    from .logs import logging_config

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
            timeout_graceful_shutdown=settings.graceful_timeout_s,
            # Loading torch and the index can take a while on a busy machine.
            timeout_worker_healthcheck=60,
        )
    except SystemExit as exit_:  # uvicorn exits 3 when the app fails to start (bad index, ...)
        return exit_.code if isinstance(exit_.code, int) else 1
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        if multiproc_dir is not None:
            os.environ.pop(MULTIPROC_ENV, None)
            shutil.rmtree(multiproc_dir, ignore_errors=True)
    return 0


def _exit_cleanly(signum: int, frame: Optional[types.FrameType]) -> None:
    raise SystemExit(0)


def _is_loopback(host: str) -> bool:
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
