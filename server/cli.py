"""`espn serve` and `espn route`: their parsers, which the `espn` command loads by entry point.

`register` adds them (entry point `espn.commands`); their code is espn_server.commands.

Each flag overrides its environment variable (`--port` over `ESPN_PORT`), which overrides
the default. The API key is read only from `ESPN_API_KEY`, never from a flag, so it does
not show in `ps`. The flags are made from the settings' fields (server.settings_doc), so
building them imports pydantic only: `espn --help` loads no uvicorn, torch or FAISS.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .router_settings import RouterSettings
from .settings import ServerSettings
from .settings_doc import add_flags, environment_help, settings_of

__all__ = ["add_serve_arguments", "add_route_arguments", "register", "run_command", "SERVE_GROUPS"]

# `espn serve --help` groups its flags thus; a field named in no group is listed under
# "other settings" (server/settings_doc.py makes one flag per ServerSettings field).
SERVE_GROUPS = (
    ("indexes", ("indexes", "index_idle_close_s", "index_root", "models", "index_memory_budget_mib", "ram_mib",
                 "index_ram_mib")),
    ("listening", ("host", "port", "workers", "preload", "graceful_timeout_s")),
    ("connections", ("max_connections", "header_timeout_s", "body_timeout_s", "keep_alive_s")),
    ("search", ("reader", "device", "batch_wait_ms", "max_batch_size", "search_threads", "inline_search_ms",
                "torch_threads", "max_pending", "fair_chunk_queries")),
    ("reader I/O (posix reader only)", ("io_engine", "io_depth", "max_extent_bytes", "direct", "record_cache_mb")),
    ("requests", ("max_body_bytes", "max_batch_queries", "max_batch_writes", "max_request_work", "max_response_bytes",
                  "cors_origins", "api_keys_file")),
    ("writes to a live index", ("read_only", "write_wait_s", "write_nice", "write_queue", "compact_max_segments",
                                "compact_merge_factor", "compact_base_ratio", "compact_deleted_fraction",
                                "max_metadata_fields", "max_metadata_bytes", "max_index_fields", "page_memory_bytes")),
    ("replication", ("publish", "publish_interval_s", "publish_keep", "writer_name", "writer_lease_s", "shard_map",
                     "follow", "follow_interval_s", "advertise_url", "snapshot_dir")),
    ("operations", ("log_level", "warmup", "metrics_port", "trust_remote_code")),
)


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add `serve` and `route` to the `espn` subcommands."""
    p = sub.add_parser("serve", help="serve an index over HTTP (FastAPI under uvicorn)")
    add_serve_arguments(p)
    p.set_defaults(handler=run_command)
    p = sub.add_parser("route", help="fan queries out to index partition servers and merge their top-k")
    add_route_arguments(p)
    p.set_defaults(handler=run_command)
    p = sub.add_parser("key-hash", help="print the SHA-256 of an API key read from stdin, as a keys file "
                                        "(`espn serve --api-keys-file`) holds it")
    p.set_defaults(handler=run_command, command="key-hash")


def run_command(args: argparse.Namespace) -> int:
    """Run `args.command` (serve or route); its exit status."""
    from .commands import COMMANDS  # entry point: uvicorn, torch and the index load now, after logging is configured

    return COMMANDS[args.command](args)


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `espn route`: one per RouterSettings field, each defaulting to its ESPN_ROUTER_* variable."""
    add_flags(parser, RouterSettings, [("routing", ("shards", "timeout_ms", "max_connections")),
                                       ("writes", ("writers", "write_timeout_ms")),
                                       ("listening", ("host", "port", "log_level"))])
    parser.epilog = environment_help(RouterSettings)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `espn serve`: INDEX, then one flag per ServerSettings field (its ESPN_* variable)."""
    (index,) = [s for s in settings_of(ServerSettings) if s.name == "index"]
    parser.add_argument("index", type=Path, metavar="INDEX", nargs="?", help=index.help)
    add_flags(parser, ServerSettings, SERVE_GROUPS)
    parser.epilog = environment_help(ServerSettings)
