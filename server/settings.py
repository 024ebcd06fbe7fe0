"""Server and router configuration: `ServerSettings` (`ESPN_*`) and `RouterSettings` (`ESPN_ROUTER_*`).

The one source of truth for settings: every `ESPN_*` variable the code reads is a field of
one of these models, and each field's description and default are what `espn serve --help`,
`espn route --help` and the docs' settings tables (docs/reference/settings.md) show (server/settings_doc.py renders
them; a field with no description fails tests/test_settings_doc.py).

`espn serve` turns its flags into these environment variables before it starts uvicorn,
so every worker process builds the identical settings (and the identical app) from its
environment: flag > environment variable > default. Construction fails fast: a missing
index, an unknown reader, a bound out of range or an unusable API key stops the server
before it binds a port.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from espn.engine import RULES, IndexConfig, ServeConfig

from .auth import Keyring, check_keys_file
from .connection_limits import (ConnectionLimits, check_connections_below_limit, connection_limits,
                                default_max_connections, descriptor_limit, listen_backlog)
from .index_names import default_index_path, resolve_indexes, split_entries
from .index_settings import IndexSettings
from .metrics_dir import record_cache_share

__all__ = ["ServerSettings", "ENV_PREFIX", "ROUTER_ENV_PREFIX", "settings_error_line", "MIN_API_KEY_CHARS",
           "ConnectionLimits", "check_api_key", "default_max_connections", "descriptor_limit", "listen_backlog"]

ENV_PREFIX = "ESPN_"
ROUTER_ENV_PREFIX = "ESPN_ROUTER_"
#: A key this short can be guessed; `openssl rand -hex 32` gives 64 characters.
MIN_API_KEY_CHARS = 16
# Printable ASCII without spaces: the key travels in an HTTP header, where surrounding
# whitespace is stripped and other bytes are not portable.
_API_KEY_CHARS = re.compile(r"^[\x21-\x7e]+$")
#: The library's defaults of how an index is served: the settings' defaults are these.
_SERVED = IndexConfig()
READER_NAMES = RULES.reader_names


LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class KeyedSettings(BaseModel):
    """What the server's and the router's settings share about API keys: each declares the two
    fields (its own variables and words), this checks them and makes the keyring."""

    api_key: Optional[SecretStr] = None
    api_keys_file: Optional[Path] = None

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, value: Optional[SecretStr]) -> Optional[SecretStr]:
        return check_api_key(value)

    @field_validator("api_keys_file")
    @classmethod
    def _check_api_keys_file(cls, value: Optional[Path]) -> Optional[Path]:
        return keys_file(value)

    @property
    def keyed(self) -> bool:
        """Whether requests need an API key."""
        return self.api_key is not None or self.api_keys_file is not None

    def keyring(self) -> Keyring:
        return Keyring(self.api_key.get_secret_value() if self.api_key is not None else None, self.api_keys_file)


class ServerSettings(IndexSettings, KeyedSettings, BaseSettings):
    """Everything `espn serve` can be told; each field is `ESPN_<NAME>` in the environment."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    # What to serve.
    index: Optional[Path] = Field(None, description="index directory (the one holding manifest.json): the default "
                                    "index, served by /v1/search, /v1/documents, ...; unset: the --index named "
                                    "`default`, else the first --index; neither: no default index (with "
                                    "--index-root, every index is named: /v1/indexes/{name}/...)")
    reader: Optional[str] = Field(None, description=f"embedding reader ({', '.join(READER_NAMES)}); unset: kvikio "
                                                    "with CUDA, else posix")
    device: Optional[str] = Field(None, description="torch device for MaxSim; unset: the library's choice")

    # Where and how many processes.
    host: str = Field("127.0.0.1", description="interface to bind; 0.0.0.0 for every interface")
    port: int = Field(8000, ge=0, le=65535, description="TCP port, 0 for any free one")
    workers: int = Field(1, ge=1, le=64, description="worker processes sharing the memory-mapped index")
    preload: bool = Field(True, description="with workers > 1: import torch & co once and fork the workers "
                                            "(false: each worker starts a fresh interpreter)")
    graceful_timeout_s: int = Field(30, ge=1, le=3600,
                                    description="seconds in-flight requests get after SIGTERM")

    # Connections (server/connections.py): what a client that sends nothing, or trickles, can hold.
    max_connections: Optional[int] = Field(
        None, ge=1, le=1_000_000,
        description="open client connections per worker; past it the oldest connection waiting for a request is "
                    "closed (or, all busy, the new one gets 503); unset: the open-file limit (`ulimit -n`) less a "
                    "quarter of it (at least 64) kept for the index's files and less 4 listen backlogs (limit / 32, "
                    "8 to 2048); 160 under `ulimit -n 256`")
    header_timeout_s: float = Field(10.0, gt=0.0, le=3600.0,
                                    description="a connection must send a whole request head within this many "
                                                "seconds of opening (or of its previous answer), else it is closed")
    body_timeout_s: float = Field(30.0, gt=0.0, le=3600.0,
                                  description="a request body must arrive whole within this many seconds; a slower "
                                              "one gets 408 and the connection is closed")
    keep_alive_s: int = Field(5, ge=1, le=3600, description="how long an idle keep-alive connection is kept open")

    # Micro-batching, continuous: an idle worker searches a query at once; what arrives while a
    # search runs shares the next Searcher.search call (at most `max_batch_size` queries).
    batch_wait_ms: float = Field(_SERVED.batch_wait_ms, ge=0.0, le=1000.0, description="with search threads > 1 and a search running, "
                                 "how long a free thread waits for more queries (an idle worker never waits)")
    max_batch_size: int = Field(_SERVED.max_batch_size, ge=1, le=1024, description="most queries per search call")
    search_threads: int = Field(_SERVED.search_threads, ge=1, le=64, description="Searcher.search calls running at once per worker")
    inline_search_ms: float = Field(
        _SERVED.inline_search_ms, ge=0.0, le=10_000.0, description="a lone query, when no other request is in progress on the worker, "
        "is searched on its event loop instead of a search thread (an answer 0.36 ms sooner on a 2-vCPU VM) while "
        "such searches take under this many ms; 0: always on a search thread")
    max_pending: int = Field(_SERVED.max_pending, ge=1, le=1_000_000, description="queued queries per worker before 503")
    torch_threads: Optional[int] = Field(None, ge=1, le=256, description="torch threads per worker; unset: cores / workers")

    # Reader I/O (the posix reader only; None keeps the library default).
    io_engine: Optional[Literal["auto", "io_uring", "aio", "threads"]] = Field(
        None, description="posix read engine; unset or auto: io_uring, then aio, then threads")
    io_depth: Optional[int] = Field(None, ge=1, le=4096, description="extents in flight at once; unset: 64")
    max_extent_bytes: Optional[int] = Field(None, ge=1, description="cap on one coalesced read; unset: 1 MiB")
    direct: Optional[bool] = Field(None, description="false: buffered reads instead of O_DIRECT; unset: O_DIRECT")
    ram_mib: Optional[float] = Field(
        None, ge=0.0, le=float(1 << 30),
        description="RAM (MiB) each index may use (per index; --index-ram NAME=MIB sets one index's): the posix "
                    "reader's first stage keeps what it must resident and the rest holds the record cache of "
                    "frequently read records, one copy shared by the workers (`espn stats INDEX --ram-mib N` "
                    "shows the split); unset: the cache gets a quarter of the record table, at most an eighth of "
                    "the machine's RAM")
    record_cache_mb: Optional[float] = Field(None, ge=0.0, le=1 << 20,
                                             description="RAM (MiB) of the record cache in front of the posix "
                                                         "reader, instead of what --ram-mib leaves it; 0: off")

    # Request limits.
    max_body_bytes: int = Field(1 << 20, ge=1024, le=1 << 30, description="largest request body; larger is a 413")
    max_batch_queries: int = Field(256, ge=1, le=10_000, description="queries accepted by /v1/search/batch")
    max_batch_writes: int = Field(1000, ge=1, le=1000,
                                  description="most upserts, and most deletes, in one /v1/documents/batch")
    # Work budget of one request: queries x max(k, rerank_count, prefetch_k) candidates.
    # The default admits 256 queries at k = 1000 but not a 256-query batch re-ranking 10,000 each.
    max_request_work: int = Field(_SERVED.max_request_work, ge=1, le=1 << 40,
                                  description="most queries x max(k, rerank_count, prefetch_k) per request")
    max_response_bytes: int = Field(_SERVED.max_response_bytes, ge=1024, le=1 << 34,
                                    description="largest estimated response (hits x bytes per hit, text included)")
    # A big batch runs as chunks of this many queries, taking turns with other requests.
    fair_chunk_queries: int = Field(_SERVED.fair_chunk_queries, ge=1, le=1024, description="queries a batch request searches per turn")

    # Security and cross-origin access.
    api_key: Optional[SecretStr] = Field(
        None, description=f"if set, /v1/* needs `Authorization: Bearer <key>`; at least {MIN_API_KEY_CHARS} printable "
                          "characters, no spaces (an empty value is refused: unset the variable to serve without a "
                          "key); environment only, never a flag")
    api_keys_file: Optional[Path] = Field(
        None, description="a JSON file of API keys scoped to indexes and roles (read, write, admin), each given by "
                          "its SHA-256 (`espn key-hash` prints it): see docs/guides/security.md; reloaded when it "
                          "changes; with ESPN_API_KEY, that key keeps full access")
    cors_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="browser origins allowed to call the API (JSON list or comma-separated); "
                                          "empty: CORS off")

    # A read replica of an index published to object storage (`espn publish`).
    follow: Optional[str] = Field(None, description="s3://BUCKET/PREFIX to follow: serve read-only the newest "
                                                    "generation published there, fetched into the index directory "
                                                    "(restored there first when it does not exist)")
    follow_interval_s: float = Field(_SERVED.follow_interval_s, gt=0.0, le=3600.0, description="how often a follower looks for a new generation")
    publish: Optional[str] = Field(None, description="s3://BUCKET/PREFIX: this server is the index's writer and "
                                                     "publishes each new generation there (for followers and backup)")
    publish_interval_s: float = Field(_SERVED.publish_interval_s, gt=0.0, le=3600.0,
                                      description="how often the writer looks for a generation to publish")
    snapshot_dir: Optional[Path] = Field(None, description="where POST /v1/snapshots writes snapshots (a directory "
                                                           "on the index's filesystem shares immutable files by hard "
                                                           "links); unset: snapshots over HTTP are off")
    publish_keep: Optional[int] = Field(None, ge=1, le=1_000_000,
                                        description="keep the newest N generations on object storage (and blobs "
                                                    "younger than an hour); unset: keep every generation")
    writer_name: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9._:@-]{1,100}$", description="--publish: this "
                                       "writer's stable name in its partition's lease (a pod name); unset: the host name")
    writer_lease_s: float = Field(_SERVED.writer_lease_s, ge=RULES.min_lease_s, le=RULES.max_lease_s,
                                  description="--publish: the writer lease's length; a standby takes over from a "
                                              "writer that has not renewed it this long")
    advertise_url: Optional[str] = Field(None, pattern=r"^https?://[^\s/]+$", description="the base URL others reach "
                                         "this server at (http://POD_IP:8000), where `espn route --shard-map` finds it")
    shard_map: Optional[str] = Field(None, description="--publish: s3://BUCKET/PREFIX of the shard map this partition "
                                     "is in: its slots say which ids it takes, and it takes part in reshards")

    # Writes to a live index (PUT/DELETE /v1/documents, POST /v1/documents/batch).
    read_only: Optional[bool] = Field(
        None, description="refuse writes (409); unset: read-only only when the index directory is not writable")
    write_wait_s: float = Field(_SERVED.write_wait_s, ge=0.0, le=600.0, description="how long a write waits for the writer lock")
    write_nice: int = Field(_SERVED.write_nice, ge=0, le=19, description="CPU priority (nice) of write encoding and compaction threads")
    write_queue: int = Field(_SERVED.write_queue, ge=1, le=1_000_000,
                             description="documents and deletes queued per worker before writes get 503")
    compact_max_segments: int = Field(_SERVED.compact_max_segments, ge=1, le=10_000, description="merge deltas in the background past this many")
    compact_merge_factor: int = Field(_SERVED.compact_merge_factor, ge=2, le=1000, description="deltas merged into one at a time")
    compact_base_ratio: float = Field(_SERVED.compact_base_ratio, gt=0.0, le=100.0,
                                      description="rewrite the base once deltas hold this fraction of its documents")
    compact_deleted_fraction: float = Field(_SERVED.compact_deleted_fraction, gt=0.0, le=1.0,
                                            description="... or past this fraction of deleted/replaced documents")
    max_metadata_fields: int = Field(_SERVED.max_metadata_fields, ge=1, le=10_000, description="metadata fields per document")
    max_metadata_bytes: int = Field(_SERVED.max_metadata_bytes, ge=64, le=16 << 20,
                                    description="a document's metadata as JSON, in bytes")
    page_memory_bytes: int = Field(_SERVED.page_memory_bytes, ge=1 << 20, le=1 << 40,
                                   description="decoded page images a worker holds at once, every write and index "
                                               "together; a page over it is a 413, a write that waits for it too long "
                                               "a 503")
    max_index_fields: int = Field(_SERVED.max_index_fields, ge=1, le=100_000, description="distinct metadata fields per index")

    # Operations.
    log_level: LogLevel = Field("info", description="server log level")
    warmup: bool = Field(_SERVED.warmup, description="warm the index (searches and, unless read-only, the write path's encoder) "
                                               "before /readyz reports ready")
    metrics_port: Optional[int] = Field(
        None, ge=1, le=65535, description="serve /metrics on this port only, not on the API port; unset: on the API "
                                          "port")
    trust_remote_code: bool = Field(False, description="open an index built with --trust-remote-code: run Python "
                                                      "code from its model directory (without it such an index is "
                                                      "refused at start-up, never asked about)")

    @field_validator("index")
    @classmethod
    def _check_index(cls, value: Optional[Path]) -> Optional[Path]:
        if value is None:
            return None
        value = value.expanduser().resolve()
        if not RULES.is_index_directory(value):
            raise ValueError(f"{value} is not an ESPN index directory (no manifest.json)")
        return value

    @field_validator("snapshot_dir")
    @classmethod
    def _absolute(cls, value: Optional[Path]) -> Optional[Path]:
        return value.expanduser().resolve() if value is not None else None

    @field_validator("follow", "publish", "shard_map")
    @classmethod
    def _check_store_url(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not (value.startswith("s3://") and value[5:].split("/", 1)[0]):
            raise ValueError(f"{value!r}: expected s3://BUCKET[/PREFIX]")
        return value

    @field_validator("reader")
    @classmethod
    def _check_reader(cls, value: Optional[str]) -> Optional[str]:
        if value in (None, "", "auto"):
            return None
        if value not in READER_NAMES:  # espn.store.READERS by name (tests/test_cli.py checks they agree)
            raise ValueError(f"reader must be one of {', '.join(READER_NAMES)}, got {value!r}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_index(cls, data: Any) -> Any:
        """Without INDEX, the default index is the --index named `default`, else the first one."""
        if isinstance(data, dict) and data.get("index") in (None, "") and data.get("indexes"):
            data = {**data, "index": default_index_path(split_entries(data["indexes"]))}
        return data

    @model_validator(mode="after")
    def _check_indexes(self) -> "ServerSettings":
        if self.index is None and self.index_root is None:
            raise ValueError("no index to serve: give INDEX, --index or --index-root")
        if self.index is None and (self.follow is not None or self.publish is not None):
            raise ValueError("--follow and --publish replicate one index: give INDEX")
        if len(self.index_map()) > 1 and (self.follow is not None or self.publish is not None):
            raise ValueError("--follow and --publish replicate one index: serve several indexes without them")
        return self

    def index_map(self) -> dict[str, Path]:
        """Every index served, by name, the default index first (resolved directories)."""
        return resolve_indexes(self.index, self.indexes, self.index_root)

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: Any) -> Any:
        return split_entries(value)  # ESPN_CORS_ORIGINS may be a JSON list or a comma-separated string

    @model_validator(mode="after")
    def _check_replication(self) -> "ServerSettings":
        if self.publish is not None and self.follow is not None:
            raise ValueError("--publish (this server writes) and --follow (it copies a writer) exclude each other")
        if self.publish is not None and self.read_only:
            raise ValueError("--publish makes this server the writer: it cannot also be --read-only")
        if self.publish is not None and self.workers > 1:  # the lease holder is the process that acknowledges
            raise ValueError("--publish runs one worker (--workers 1); searches scale on followers (--follow)")
        return self

    @model_validator(mode="after")
    def _check_batching(self) -> "ServerSettings":
        if self.max_pending < self.max_batch_size:
            raise ValueError("max_pending must be at least max_batch_size")
        return self

    @model_validator(mode="after")
    def _check_max_connections(self) -> "ServerSettings":
        check_connections_below_limit(self.max_connections)
        return self

    def connection_limits(self) -> ConnectionLimits:
        """The per-worker limits server.connections enforces."""
        return connection_limits(self.max_connections, self.header_timeout_s)

    @model_validator(mode="after")
    def _check_metrics_port(self) -> "ServerSettings":
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError("metrics_port must differ from port")
        return self

    @model_validator(mode="after")
    def _check_reader_options(self) -> "ServerSettings":
        if self.reader_options() and self.reader not in (None, "posix"):
            raise ValueError(f"io_engine, io_depth, max_extent_bytes and direct apply to the posix reader only, "
                             f"not reader {self.reader!r}")
        return self

    def reader_options(self) -> dict[str, Any]:
        """Searcher.open(reader_options=...): only the options that were set."""
        options: dict[str, Any] = {}
        if self.io_engine is not None:
            options["io_engine"] = None if self.io_engine == "auto" else self.io_engine
        for name in ("io_depth", "max_extent_bytes", "direct"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return options

    @property
    def effective_torch_threads(self) -> int:
        """Intra-op threads per worker so that N workers do not oversubscribe the cores."""
        if self.torch_threads is not None:
            return self.torch_threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // self.workers)

    def serve_config(self) -> ServeConfig:
        """What the engine is told: the indexes, the root and its models, and how each index is served."""
        served = {name: getattr(self, name) for name in (
            "reader", "device", "trust_remote_code", "max_batch_size", "batch_wait_ms", "search_threads",
            "inline_search_ms", "max_pending", "fair_chunk_queries", "max_request_work", "max_response_bytes",
            "read_only", "write_wait_s", "write_nice", "write_queue", "compact_max_segments", "compact_merge_factor",
            "compact_base_ratio", "compact_deleted_fraction", "max_metadata_fields", "max_metadata_bytes",
            "max_index_fields", "page_memory_bytes", "warmup", "follow", "follow_interval_s", "publish", "publish_interval_s",
            "publish_keep", "writer_name", "writer_lease_s", "advertise_url", "shard_map", "snapshot_dir", "ram_mib",
            "record_cache_mb")}
        indexes = self.index_map()
        return ServeConfig(indexes=indexes, default=next(iter(indexes)) if self.index is not None else None,
                           root=self.creation_root(), models=self.model_map(),
                           memory_budget_mib=self.index_memory_budget_mib, index_ram_mib=self.index_ram_map(),
                           idle_close_s=self.index_idle_close_s, graceful_s=float(self.graceful_timeout_s),
                           index=IndexConfig(reader_options=self.reader_options(), torch_threads=self.effective_torch_threads,
                                             record_cache_share=record_cache_share(), **served))

    def to_env(self) -> dict[str, str]:
        """The environment variables that rebuild these settings in another process."""
        env: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, list):
                value = json.dumps(value)
            elif isinstance(value, bool):
                value = "true" if value else "false"
            env[ENV_PREFIX + name.upper()] = str(value)
        return env

    def describe(self) -> dict[str, Any]:
        """Settings as printed at start-up: JSON-safe, the API key masked."""
        out = self.model_dump(mode="json")
        out["api_key"] = "***" if self.api_key is not None else None
        return out


def keys_file(value: Optional[Path]) -> Optional[Path]:
    """A keys file that reads (server.auth), as an absolute path; a bad one stops the server at start."""
    if value is None:
        return None
    value = value.expanduser().resolve()
    check_keys_file(value)
    return value


def check_api_key(value: Optional[SecretStr]) -> Optional[SecretStr]:
    """The server's and the router's key: unset, or at least MIN_API_KEY_CHARS printable characters."""
    # An empty ESPN_API_KEY (a secret that did not mount, `ESPN_API_KEY=$UNSET`) must not
    # quietly turn authentication off: only an unset variable means "no key".
    if value is None:
        return None
    key = value.get_secret_value()
    if key == "":
        raise ValueError("is empty; unset ESPN_API_KEY to serve without a key, or give one of at least "
                         f"{MIN_API_KEY_CHARS} characters (e.g. `openssl rand -hex 32`)")
    if len(key) < MIN_API_KEY_CHARS:
        raise ValueError(f"has {len(key)} characters; at least {MIN_API_KEY_CHARS} are needed "
                         "(e.g. `openssl rand -hex 32`)")
    if not _API_KEY_CHARS.match(key):
        raise ValueError("must be printable ASCII without spaces (it is sent in an HTTP header)")
    return value


def settings_error_line(command: str, prefix: str, error: ValidationError) -> str:
    """Every problem of a settings model in one line, each naming its variable."""
    problems = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"])
        message = str(item["msg"]).removeprefix("Value error, ")
        problems.append(f"{field} ({prefix}{field.upper()}) {message}" if field else message)
    return f"espn {command}: error: " + "; ".join(problems)
