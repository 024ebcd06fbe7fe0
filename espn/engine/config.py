"""How an engine serves its indexes: one frozen config per index and one for the registry.

The entry point (the server's settings, or a Python caller) builds these once; the engine
reads nothing from argv or the environment. The defaults are the library's: a caller that
sets nothing gets what `espn serve` gets without flags.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Optional

from ..choices import DEFAULT_LEASE_S
from ..files.index_directory import is_index_directory
from ..pages.memory import DEFAULT_PAGE_MEMORY_BYTES
from .rules import RULES

__all__ = ["IndexConfig", "ServeConfig", "DEFAULT_INDEX_NAME"]

#: The name of the default index when nothing names it.
DEFAULT_INDEX_NAME = "default"


@dataclasses.dataclass(frozen=True)
class IndexConfig:
    """How each index is opened, searched and written (the same for every index of a registry).

    Reading: reader (None: kvikio where CUDA works, else posix), device, reader_options (the
    reader's open options), torch_threads (per process), trust_remote_code.
    RAM (espn.store.ram_plan): ram_mib, what the index may use (None: the library's default
    split), of which its first stage keeps what it must resident and the posix reader's record
    cache gets the rest; record_cache_mb, the cache's size instead of what ram_mib leaves it
    (0: none); record_cache_share, the key under which the processes of one server map one
    copy of each index's cache (None: each process keeps its own).
    Searching: micro-batching (max_batch_size, batch_wait_ms, search_threads, inline_search_ms,
    max_pending, fair_chunk_queries) and the work budget of one request (max_request_work,
    max_response_bytes).
    Writing: read_only (None: decided from the index's files), the writer lock's wait, the
    write threads' nice level, the queue, the compaction policy, the metadata limits, and
    the decoded page images this process holds at once (espn.pages.memory).
    Replication: follow or publish an object-store prefix; a publishing writer is fenced by a
    lease on the store (writer_name in it, None: the host name; writer_lease_s) and takes the
    slots of a shard map (shard_map) when given one; advertise_url is where others reach this
    server (written into its lease, or its replica record when it follows); snapshot_dir for
    snapshots by name.
    """

    reader: Optional[str] = None
    device: Optional[str] = None
    reader_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    torch_threads: int = 1
    trust_remote_code: bool = False
    ram_mib: Optional[float] = None
    record_cache_mb: Optional[float] = None
    record_cache_share: Optional[str] = None
    max_batch_size: int = 32
    batch_wait_ms: float = 2.0
    search_threads: int = 1
    inline_search_ms: float = 25.0
    max_pending: int = 4096
    fair_chunk_queries: int = 8
    max_request_work: int = 262_144
    max_response_bytes: int = 16 << 20
    read_only: Optional[bool] = None
    write_wait_s: float = 10.0
    write_nice: int = 10
    write_queue: int = 10_000
    compact_max_segments: int = 8
    compact_merge_factor: int = 4
    compact_base_ratio: float = 0.5
    compact_deleted_fraction: float = 0.2
    max_metadata_fields: int = 64
    max_metadata_bytes: int = 16 << 10
    max_index_fields: int = 256
    page_memory_bytes: int = DEFAULT_PAGE_MEMORY_BYTES
    warmup: bool = True
    follow: Optional[str] = None
    follow_interval_s: float = 2.0
    publish: Optional[str] = None
    publish_interval_s: float = 0.5
    publish_keep: Optional[int] = None
    writer_name: Optional[str] = None
    writer_lease_s: float = DEFAULT_LEASE_S
    advertise_url: Optional[str] = None
    shard_map: Optional[str] = None
    snapshot_dir: Optional[Path] = None

    def replace(self, **changes: Any) -> "IndexConfig":
        return dataclasses.replace(self, **changes)

    def open_options(self) -> dict[str, Any]:
        """Searcher.open's reader options: the reader's own, the RAM plan and the record cache
        (filled from the file by the process that makes it, before the index is ready)."""
        options = {**self.reader_options, "ram_mib": self.ram_mib, "record_cache_warm": True}
        if self.record_cache_mb is not None:
            options["record_cache_mb"] = self.record_cache_mb
        if self.record_cache_share is not None:
            options["record_cache_share"] = self.record_cache_share
        return options


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """The indexes of one registry and how it holds them.

    indexes:          name -> directory of the indexes held from the start
    default:          the default index's name, one of `indexes` (None: no default index; then every
                      request names its index, /v1/indexes/{name}/...)
    root:             where indexes are created and deleted by name (None: they are not)
    models:           name -> encoder spec that created indexes may use
    memory_budget_mib: estimated memory the open indexes may hold (0: no budget)
    index_ram_mib:    name -> the RAM (MiB) of that index, instead of `index.ram_mib`
    idle_close_s:     close an index other than the default after this long without a request (0: never)
    graceful_s:       how long a deletion waits for the requests inside an index
    index:            how every index is served
    """

    indexes: Mapping[str, Path]
    default: Optional[str] = None
    root: Optional[Path] = None
    models: Mapping[str, str] = dataclasses.field(default_factory=dict)
    memory_budget_mib: float = 0.0
    index_ram_mib: Mapping[str, float] = dataclasses.field(default_factory=dict)
    idle_close_s: float = 0.0
    graceful_s: float = 30.0
    index: IndexConfig = IndexConfig()

    def __post_init__(self) -> None:
        for name in (*self.indexes, *self.models, *self.index_ram_mib):
            problem = RULES.index_name_problem(name)
            if problem is not None:
                raise ValueError(problem)
        if not self.indexes and self.root is None:
            raise ValueError("no index to serve: give an index or an index root")
        if self.default is not None and self.default not in self.indexes:
            raise ValueError(f"the default index {self.default!r} is not among the indexes")

    def index_config(self, name: str) -> IndexConfig:
        """How the index called `name` is served: `index`, with its own RAM where `index_ram_mib` gives one."""
        ram_mib = self.index_ram_mib.get(name)
        return self.index if ram_mib is None else self.index.replace(ram_mib=ram_mib)

    @property
    def default_name(self) -> Optional[str]:
        """The default index's name; None when the registry holds no default index."""
        return self.default

    @staticmethod
    def indexes_under(root: Path) -> dict[str, Path]:
        """name -> directory of each index in `root` (a subdirectory with a manifest, named after
        it), sorted by name; hidden names (a creation or deletion in progress) are skipped."""
        if not root.is_dir():
            return {}
        return {child.name: child.resolve() for child in sorted(root.iterdir())
                if not child.name.startswith(".") and RULES.index_name_problem(child.name) is None
                and is_index_directory(child)}
