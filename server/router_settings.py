"""`espn route`'s settings (`ESPN_ROUTER_*`): the partitions it fans out to and the writers it
sends writes to, its own listening and limits. Beside server.settings, whose rules (API keys,
connection limits, the one-line error) it shares; light, so `espn --help` builds its flags
without the router's HTTP client."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .connection_limits import ConnectionLimits, check_connections_below_limit, connection_limits
from .settings import ROUTER_ENV_PREFIX, KeyedSettings, LogLevel

__all__ = ["RouterSettings"]


class RouterSettings(KeyedSettings, BaseSettings):
    """Configuration of `espn route`; each field is `ESPN_ROUTER_<NAME>` in the environment."""

    model_config = SettingsConfigDict(env_prefix=ROUTER_ENV_PREFIX, extra="ignore", frozen=True)

    shards: Annotated[list[str], NoDecode] = Field(default_factory=list, description="base URL of each partition's "
                                                   "server (comma-separated); its replicas joined by | (http://a|http://b)")
    shard_map: Optional[str] = Field(None, pattern=r"^s3://[^/\s]+", description="s3://BUCKET/PREFIX of a shard map: "
                                     "partitions, replicas and writers from there (re-read) instead of --shards/--writers")
    writers: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="base URL of each partition's writer (`espn serve --publish`), in the order of --shards "
                    "(comma-separated); with them the router takes writes and sends each id to its partition")
    timeout_ms: float = Field(2000.0, gt=0.0, le=600_000.0,
                              description="per-shard time limit; a shard slower than this is left out and the "
                                          "answer marked partial")
    write_timeout_ms: float = Field(30_000.0, gt=0.0, le=600_000.0,
                                    description="time limit of a write at its writer; past it the answer is a 504 "
                                                "(the write may or may not have been applied)")
    host: str = Field("127.0.0.1", description="interface to bind; 0.0.0.0 for every interface")
    port: int = Field(8080, ge=0, le=65535, description="TCP port, 0 for any free one")
    max_connections: int = Field(256, ge=1, le=100_000, description="open connections per shard")
    log_level: LogLevel = Field("info", description="router log level")
    api_key: Optional[SecretStr] = Field(
        None, validation_alias=AliasChoices("ESPN_ROUTER_API_KEY", "ESPN_API_KEY"),
        description="if set, /v1/* needs `Authorization: Bearer <key>` (checked before the body is read, and passed "
                    "on to the partitions); read from ESPN_ROUTER_API_KEY, else ESPN_API_KEY like `espn serve`; "
                    "environment only, never a flag")
    api_keys_file: Optional[Path] = Field(
        None, validation_alias=AliasChoices("ESPN_ROUTER_API_KEYS_FILE", "ESPN_API_KEYS_FILE"),
        description="the keys file of `espn serve --api-keys-file` (keys scoped to indexes and roles): the router "
                    "checks each request's key and role as a server does, and passes the key on to the partitions")
    max_body_bytes: int = Field(1 << 20, ge=1024, le=1 << 30, description="largest request body; larger is a 413")
    max_client_connections: Optional[int] = Field(
        None, ge=1, le=1_000_000,
        description="open client connections; past it the oldest one waiting for a request is closed (or, all busy, "
                    "the new one gets 503); unset: derived from the open-file limit as for `espn serve`")
    header_timeout_s: float = Field(10.0, gt=0.0, le=3600.0,
                                    description="a connection must send a whole request head within this many seconds")
    body_timeout_s: float = Field(30.0, gt=0.0, le=3600.0,
                                  description="a request body must arrive whole within this many seconds, else 408")
    keep_alive_s: int = Field(5, ge=1, le=3600, description="how long an idle keep-alive connection is kept open")

    @model_validator(mode="after")
    def _check_max_connections(self) -> "RouterSettings":
        check_connections_below_limit(self.max_client_connections)
        return self

    def connection_limits(self) -> ConnectionLimits:
        return connection_limits(self.max_client_connections, self.header_timeout_s)

    @field_validator("shards", "writers", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        # "a,b" (the variable, or one --shards) and ["a,b", "c"] (--shards repeated) alike.
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            return [part.strip() for item in value for part in str(item).split(",") if part.strip()]
        return value

    @field_validator("shards")
    @classmethod
    def _check_shards(cls, value: list[str]) -> list[str]:
        _base_urls([url for shard in value for url in shard.split("|")], "shard")  # no URL twice, even across partitions
        return ["|".join(_base_urls(shard.split("|"), "shard")) for shard in value]

    @field_validator("writers")
    @classmethod
    def _check_writers(cls, value: list[str]) -> list[str]:
        return _base_urls(value, "writer")

    @model_validator(mode="after")
    def _one_writer_per_partition(self) -> "RouterSettings":
        if (not self.shards) == (self.shard_map is None):
            raise ValueError("give the partitions' URLs (--shards) or a shard map (--shard-map s3://...), one of them")
        if self.writers and len(self.writers) != len(self.shards):
            raise ValueError(f"--writers lists {len(self.writers)} URL(s) for {len(self.shards)} partition(s) in "
                             "--shards: give one writer per partition, in the same order")
        return self


def _base_urls(value: list[str], what: str) -> list[str]:
    urls = []
    for url in value:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"{what} URL must be http(s)://host[:port][/prefix], got {url!r}")
        if parts.query or parts.fragment:
            raise ValueError(f"{what} URL must not carry a query or fragment, got {url!r}")
        urls.append(url.rstrip("/"))
    duplicates = sorted({u for u in urls if urls.count(u) > 1})
    if duplicates:
        raise ValueError(f"{what} URLs repeat: {', '.join(duplicates)}")
    return urls
