"""Server configuration: one `ServerSettings`, read from `ESPN_*` environment variables.

`espn serve` turns its flags into these environment variables before it starts uvicorn,
so every worker process builds the identical settings (and the identical app) from its
environment: flag > environment variable > default. Construction fails fast: a missing
index, an unknown reader or a bound out of range stops the server before it binds a port.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["ServerSettings", "ENV_PREFIX", "READER_NAMES"]

ENV_PREFIX = "ESPN_"

# Mirrors espn.store.READERS; checked against the real registry in `_check_reader`
# when the library can be imported, so the two cannot drift silently.
READER_NAMES = ("posix", "kvikio", "mmap", "memory")

LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class ServerSettings(BaseSettings):
    """Everything `espn serve` can be told; each field is `ESPN_<NAME>` in the environment."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    # What to serve.
    index: Path = Field(description="index directory (the one holding manifest.json)")
    reader: Optional[str] = Field(None, description="embedding reader; None picks the library default")
    device: Optional[str] = Field(None, description="torch device for MaxSim; None picks the library default")

    # Where and how many processes.
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: int = Field(1, ge=1, le=64)
    preload: bool = Field(True, description="with workers > 1: import torch & co once, fork the workers")
    graceful_timeout_s: int = Field(30, ge=1, le=3600, description="in-flight requests get this long after SIGTERM")

    # Micro-batching: requests with identical parameters arriving within `batch_wait_ms`
    # share one Searcher.search call of at most `max_batch_size` queries.
    batch_wait_ms: float = Field(2.0, ge=0.0, le=1000.0)
    max_batch_size: int = Field(32, ge=1, le=1024)
    search_threads: int = Field(1, ge=1, le=64, description="Searcher.search calls running at once per worker")
    max_pending: int = Field(4096, ge=1, le=1_000_000, description="queued queries per worker before 503")
    torch_threads: Optional[int] = Field(None, ge=1, le=256, description="torch intra-op threads; None = cores / workers")

    # Reader I/O (the posix reader only; None keeps the library default).
    io_engine: Optional[Literal["auto", "io_uring", "aio", "threads"]] = Field(
        None, description="posix read engine; auto/None: io_uring, then aio, then threads")
    io_depth: Optional[int] = Field(None, ge=1, le=4096, description="extents in flight at once")
    max_extent_bytes: Optional[int] = Field(None, ge=1, description="cap on one coalesced read")
    direct: Optional[bool] = Field(None, description="False: buffered reads instead of O_DIRECT")

    # Request limits.
    max_body_bytes: int = Field(1 << 20, ge=1024, le=1 << 30)
    max_batch_queries: int = Field(256, ge=1, le=10_000, description="queries accepted by /v1/search/batch")
    # Work budget of one request: queries x max(k, rerank_count, prefetch_k) candidates.
    # The default admits 256 queries at k = 1000 but not a 256-query batch re-ranking 10,000 each.
    max_request_work: int = Field(262_144, ge=1, le=1 << 40,
                                  description="most queries x max(k, rerank_count, prefetch_k) per request")
    max_response_bytes: int = Field(16 << 20, ge=1024, le=1 << 34,
                                    description="largest estimated response (hits x bytes per hit, text included)")
    # A big batch runs as chunks of this many queries, taking turns with other requests.
    fair_chunk_queries: int = Field(8, ge=1, le=1024, description="queries a batch request searches per turn")

    # Security and cross-origin access.
    api_key: Optional[SecretStr] = Field(None, description="if set, /v1/* needs `Authorization: Bearer <key>`")
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list, description="empty: CORS off")

    # Writes to a live index (PUT/DELETE /v1/documents, POST /v1/documents/batch).
    read_only: Optional[bool] = Field(
        None, description="refuse writes (409); None: read-only when the index directory is not writable")
    write_wait_s: float = Field(10.0, ge=0.0, le=600.0, description="how long a write waits for the writer lock")
    write_nice: int = Field(10, ge=0, le=19, description="CPU priority (nice) of write encoding and compaction threads")
    write_queue: int = Field(10_000, ge=1, le=1_000_000,
                             description="documents and deletes queued per worker before writes get 503")
    compact_max_segments: int = Field(8, ge=1, le=10_000, description="merge deltas in the background past this many")
    compact_merge_factor: int = Field(4, ge=2, le=1000, description="deltas merged into one at a time")
    compact_base_ratio: float = Field(0.5, gt=0.0, le=100.0,
                                      description="rewrite the base once deltas hold this fraction of its documents")
    compact_deleted_fraction: float = Field(0.2, gt=0.0, le=1.0,
                                            description="... or past this fraction of deleted/replaced documents")
    max_metadata_fields: int = Field(64, ge=1, le=10_000, description="metadata fields per document")
    max_metadata_bytes: int = Field(16 << 10, ge=64, le=16 << 20,
                                    description="a document's metadata as JSON, in bytes")
    max_index_fields: int = Field(256, ge=1, le=100_000, description="distinct metadata fields per index")

    # Operations.
    log_level: LogLevel = "info"
    warmup: bool = True
    metrics_port: Optional[int] = Field(
        None, ge=1, le=65535, description="serve /metrics on this port only (not on the API port)")

    @field_validator("index")
    @classmethod
    def _check_index(cls, value: Path) -> Path:
        value = value.expanduser().resolve()
        if not (value / "manifest.json").is_file():
            raise ValueError(f"{value} is not an ESPN index directory (no manifest.json)")
        return value

    @field_validator("reader")
    @classmethod
    def _check_reader(cls, value: Optional[str]) -> Optional[str]:
        if value in (None, "", "auto"):
            return None
        names: tuple[str, ...] = READER_NAMES
        try:  # the library's registry is the source of truth when it is importable
            from espn.store import READERS

            names = tuple(READERS)
        except ImportError:
            pass
        if value not in names:
            raise ValueError(f"reader must be one of {', '.join(names)}, got {value!r}")
        return value

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, value: Optional[SecretStr]) -> Optional[SecretStr]:
        if value is None or value.get_secret_value() == "":
            return None
        if len(value.get_secret_value()) < 16:
            raise ValueError("api_key must be at least 16 characters")
        return value

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _split_origins(cls, value: Any) -> Any:
        # ESPN_CORS_ORIGINS may be a JSON list or a comma-separated string.
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [origin.strip() for origin in text.split(",") if origin.strip()]
        return value

    @model_validator(mode="after")
    def _check_batching(self) -> "ServerSettings":
        if self.max_pending < self.max_batch_size:
            raise ValueError("max_pending must be at least max_batch_size")
        return self

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
