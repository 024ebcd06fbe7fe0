"""The typed door of the library: what an entry point (the HTTP server, the CLI, an embedding
program) may ask of a served index and of the registry that holds indexes by name.

`Engine` is one open index: searches (micro-batched, each query isolated when asked),
documents and page images, writes (group-committed), snapshots, readiness. `Engines` is the
registry: it opens an index at its first request and closes it when idle or over the
memory budget, creates and deletes indexes in its root, and moves each through its
lifecycle (espn.engine.lifecycle). `Observer` is what an entry point lends the engine to
count what it does (the server's Prometheus metrics); `NullObserver` counts nothing.
"""

from __future__ import annotations

from typing import Any, AsyncContextManager, Mapping, Optional, Protocol, Sequence

from ..live.checks import NewDocument, WriteResult
from ..results import Document
from .messages import IndexInfo, IndexLimits, Readiness, SearchAnswer, SearchOptions, SnapshotInfo

__all__ = ["Engine", "Engines", "Observer", "NullObserver"]


class Engine(Protocol):
    """One open index, as its registry lends it for a request (`Engines.use`)."""

    name: str

    async def search(self, queries: Sequence[str], options: SearchOptions, *, isolate: bool = False) -> SearchAnswer:
        """Search `queries` with `options`, batched with concurrent requests.

        The request's own parameters are checked first (InvalidParameterError, OverBudgetError:
        nothing is queued). isolate: a query the search refuses, or whose search fails, is kept
        in the answer's `refused` or `failed` and the others are answered; without it the
        first refusal is raised."""

    async def check(self, options: SearchOptions) -> None:
        """Check a request's parameters with no query to search (what `search` checks first)."""

    async def document(self, doc_id: str) -> Document:
        """A passage by its external id (DocumentNotFoundError)."""

    async def page_image(self, doc_id: str, max_side: Optional[int] = None) -> tuple[bytes, str]:
        """A page's stored image (bytes, media type), scaled down to `max_side` when given."""

    async def write(self, upserts: Sequence[NewDocument], deletes: Sequence[str]) -> WriteResult:
        """Upserts and deletes published together as one generation, answered once durable and
        served by this process (ReadOnlyIndexError on an index served read-only)."""

    async def refit(self) -> bool:
        """Start fitting the index on its own documents again, in the background (a base rewrite:
        searches and writes go on); False when a compaction of this process already runs."""

    async def snapshot(self, name: Optional[str] = None) -> SnapshotInfo:
        """A consistent copy of the generation served now, under the snapshot directory."""

    def snapshots(self) -> list[SnapshotInfo]:
        """The snapshots under the snapshot directory."""

    def readiness(self) -> Readiness:
        """Whether it serves, its generation, reader, replication and partition."""

    def limits(self) -> Optional[IndexLimits]:
        """What its requests may ask that depends on the index (None: not open)."""


class Engines(Protocol):
    """The indexes of a process by name, each through its lifecycle."""

    @property
    def default_name(self) -> Optional[str]:
        """The default index's name; None when the registry holds no default index."""

    async def start(self) -> None:
        """Open the default index (failing if it cannot), then warm it and start closing idle indexes."""

    async def close(self) -> None:
        """Close every index: queued searches answered, accepted writes published."""

    def use(self, name: Optional[str] = None) -> AsyncContextManager[Engine]:
        """The named index (None: the default) for one request, opened first when closed.
        IndexNotFoundError for a name not held; UnavailableError while it cannot open."""

    def describe(self) -> list[IndexInfo]:
        """Every index held, the default first."""

    def info(self, name: str) -> IndexInfo:
        """One index held (IndexNotFoundError)."""

    def readiness(self) -> Readiness:
        """The default index's readiness (with no default index: ready once started)."""

    async def create(self, name: str, model: str) -> IndexInfo:
        """An empty index in the root, with one of the configured models."""

    async def delete(self, name: str) -> None:
        """Refuse new requests to `name`, let those inside finish, close it, remove its directory."""

    def replication(self) -> Optional[Mapping[str, Any]]:
        """The default index's follower or publisher status, if it has one."""

    def limits(self) -> Optional[IndexLimits]:
        """The default index's limits (espn.engine.IndexLimits), None while it is not open."""


class Observer(Protocol):
    """What the engine reports as it works (the server's metrics implement it)."""

    def observe_query(self, *, queue_ms: float, hit_rate: float, prefetched: int, missed: int,
                      bytes_read: int, ios: int) -> None: ...

    def observe_batch(self, size: int, stage_ms: Mapping[str, float]) -> None: ...

    def observe_waves(self, waves: int, skipped: int) -> None: ...

    def set_queued(self, queries: int) -> None: ...

    def set_record_cache(self, stats: Optional[Mapping[str, Any]], ram: Optional[Mapping[str, Any]] = None) -> None:
        """The record cache's counters (None: no cache) and the RAM plan the reader was opened with."""

    def set_prefetch(self, estimates: Any) -> None: ...

    def set_reader(self, reader: str, engine: str) -> None: ...

    def set_ready(self, ready: bool) -> None: ...

    def set_index(self, name: str, is_open: bool, documents: int) -> None: ...

    def set_index_memory(self, name: str, estimated_bytes: int) -> None: ...

    def forget_index(self, name: str) -> None: ...

    def count_index_request(self, name: str) -> None: ...

    def observe_compaction(self, name: str, kind: str, seconds: float) -> None: ...


class NullObserver:
    """An Observer that keeps nothing (an engine embedded in a program)."""

    def observe_query(self, *, queue_ms: float, hit_rate: float, prefetched: int, missed: int,
                      bytes_read: int, ios: int) -> None:
        pass

    def observe_batch(self, size: int, stage_ms: Mapping[str, float]) -> None:
        pass

    def observe_waves(self, waves: int, skipped: int) -> None:
        pass

    def set_queued(self, queries: int) -> None:
        pass

    def set_record_cache(self, stats: Optional[Mapping[str, Any]], ram: Optional[Mapping[str, Any]] = None) -> None:
        pass

    def set_prefetch(self, estimates: Any) -> None:
        pass

    def set_reader(self, reader: str, engine: str) -> None:
        pass

    def set_ready(self, ready: bool) -> None:
        pass

    def set_index(self, name: str, is_open: bool, documents: int) -> None:
        pass

    def set_index_memory(self, name: str, estimated_bytes: int) -> None:
        pass

    def forget_index(self, name: str) -> None:
        pass

    def count_index_request(self, name: str) -> None:
        pass

    def observe_compaction(self, name: str, kind: str, seconds: float) -> None:
        pass
