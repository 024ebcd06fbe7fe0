"""One index served in this process: `ServedIndex` implements the Engine protocol over a live
index's newest generation (searches, documents, writes, snapshots), and opens and closes it.

Its lifecycle (espn.engine.lifecycle) is moved by its registry; what it owns in between is
released in `close`: queued searches are answered, accepted writes published (and uploaded
when it publishes to object storage), the Searcher closed once no search holds it, and its
share of a loaded encoder given back.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..encoders.shared import SharedEncoders
from ..errors import EspnError, IndexNotFoundError, NotEnabledError, ReadOnlyIndexError, UnavailableError
from ..files.index_directory import is_index_directory
from ..live.checks import NewDocument, WriteResult
from ..live.replication.fenced import FencedWriter
from ..live.replication.follower import Follower
from ..live.snapshot import default_name, remove_leftovers, snapshot, snapshots_in
from ..live.staging import remove_write_leftovers
from ..live.status import read_only_reason
from ..params import FIRST_STAGE_KINDS
from ..partitioning import PartitionLayout
from ..results import Document
from ..search.live_searcher import LiveSearcher
from .config import IndexConfig
from .lifecycle import IndexLife
from .memory import estimate_bytes
from .messages import IndexLimits, Lifecycle, Readiness, SearchAnswer, SearchOptions, SnapshotInfo
from .protocol import Observer
from .searching import Searching, open_searcher
from .writing import Writing

__all__ = ["ServedIndex"]

logger = logging.getLogger(__name__)


class ServedIndex:
    """One index by name: its lifecycle, and while open its searches and writes (the Engine protocol).

    default: the registry's default index (opened at start, never closed when idle, its readiness
    the process's); the others open at their first request."""

    def __init__(self, name: str, path: Path, config: IndexConfig, observer: Observer, *, default: bool,
                 quiet: Callable[[], bool], documents: int = 0) -> None:
        self.name, self.path, self.config, self.observer, self.default = name, path, config, observer, default
        self.life = IndexLife()
        self.lock = asyncio.Lock()  # one open, close or deletion at a time
        self._quiet = quiet
        self.live: Optional[LiveSearcher] = None
        self.searching: Optional[Searching] = None
        self.writing: Optional[Writing] = None
        self.follower: Optional[Follower] = None
        self.publisher: Optional[FencedWriter] = None  # --publish: the partition's writer while it holds the lease
        self.read_only: Optional[bool] = None
        self.documents = documents  # as of its last open, write or close
        self.memory_bytes: Optional[int] = None
        self.last_used = time.monotonic()
        self._encoder_key: Optional[str] = None
        self._writing_made = threading.Lock()

    # -- the Engine protocol ------------------------------------------------------------

    async def search(self, queries: Sequence[str], options: SearchOptions, *, isolate: bool = False) -> SearchAnswer:
        return await self._searching().search(queries, options, isolate=isolate)

    async def check(self, options: SearchOptions) -> None:
        await self._searching().check(options)

    async def document(self, doc_id: str) -> Document:
        return await self._searching().document(doc_id)

    async def page_image(self, doc_id: str, max_side: Optional[int] = None) -> tuple[bytes, str]:
        return await asyncio.to_thread(self._searching().page_image, doc_id, max_side)

    async def write(self, upserts: Sequence[NewDocument], deletes: Sequence[str]) -> WriteResult:
        try:
            result = await self._writing().apply(upserts, deletes)
        except (OSError, EspnError) as exc:
            if not self.default and not is_index_directory(self.path):  # deleted meanwhile, by another process
                raise IndexNotFoundError(f"index {self.name!r} was deleted while the write ran; nothing of it "
                                         "is kept") from exc
            raise
        if self.live is not None:
            self.documents = self.live.current.searchable_documents
        return result

    async def refit(self) -> bool:
        return await asyncio.to_thread(self._writing().refit)

    async def snapshot(self, name: Optional[str] = None) -> SnapshotInfo:
        directory = self._snapshot_dir()
        name = name or default_name()  # to the millisecond, with a random suffix: never taken
        # The library claims the name before it copies anything (a second request for it is a
        # ConflictError) and renames the copy into place only once it verifies; a full disk is
        # a StorageFullError with nothing left behind.
        result = await asyncio.to_thread(snapshot, self.path, directory / name)
        return SnapshotInfo(name, result.generation, result.files, result.linked_bytes, result.copied_bytes)

    def snapshots(self) -> list[SnapshotInfo]:
        return [SnapshotInfo(name, generation) for name, generation in snapshots_in(self._snapshot_dir())]

    def readiness(self) -> Readiness:
        live = self.live
        if live is not None and self.life.state is Lifecycle.READY:
            live.refresh()  # one stat: the generation a search would be served from now
        searcher = live.current if live is not None else None
        if searcher is None:
            return Readiness(ready=False, state=self.life.state, replication=self.replication())
        return Readiness(
            ready=self.life.state is Lifecycle.READY, state=self.life.state, generation=searcher.generation,
            read_only=self.read_only, reader=searcher.reader.describe(), replication=self.replication(),
            partition=PartitionLayout.from_manifest(searcher.manifest).to_json(),
            trust_remote_code=searcher.manifest["encoder"].get("trust_remote_code") is True)

    def limits(self) -> Optional[IndexLimits]:
        """What its requests may ask that depends on the index; None while it is not open."""
        live = self.live
        if live is None:
            return None
        searcher = live.current  # its schema and nlist only: no lease needed
        stages = ("ivf",) if searcher.centroids is None else FIRST_STAGE_KINDS
        return IndexLimits(searcher.generation, searcher.nlist, stages, dict(searcher.metadata.schema))

    # -- what the registry asks ---------------------------------------------------------

    def replication(self) -> Optional[dict[str, Any]]:
        """A follower's or a publishing writer's status (the same lag and staleness keys), or None."""
        source = self.follower or self.publisher
        return source.status() if source is not None else None

    @property
    def generation(self) -> Optional[int]:
        return self.live.current.generation if self.live is not None else None

    def estimate_memory(self) -> int:
        """What the index holds in memory when open, estimated (espn.engine.memory); cached."""
        if self.memory_bytes is None:
            self.memory_bytes = estimate_bytes(self.path, self.config)
        return self.memory_bytes

    async def open(self, encoders: SharedEncoders) -> None:
        """Open the index (its encoder shared through `encoders`) and start its searches; the
        default index also starts its replication and publishes its reader to the observer."""
        config = self.config

        def loader(directory: Path, entry: Any) -> Any:
            self._encoder_key, encoder = encoders.acquire(directory, entry, config.device, config.trust_remote_code)
            return encoder

        try:
            searcher = await asyncio.to_thread(open_searcher, self.path, config, loader)
        except BaseException:
            self._release_encoder(encoders)
            raise
        self.read_only = await asyncio.to_thread(self._decide_read_only)
        if not self.read_only:  # what killed writers left, warm-up or not
            removed = await asyncio.to_thread(remove_write_leftovers, self.path)
            if removed:
                logger.info("removed what stopped writers left", extra={"index": self.name, "removed": removed})
        if config.snapshot_dir is not None:
            await asyncio.to_thread(_snapshot_dir_ready, config.snapshot_dir)
        self.live = LiveSearcher(searcher)
        self.searching = Searching(self.live, config, self.observer, self._quiet)
        self.searching.start()
        self.documents = searcher.searchable_documents
        self.observer.set_index(self.name, True, self.documents)
        self.observer.set_index_memory(self.name, await asyncio.to_thread(self.estimate_memory))
        if self.default:
            reader = searcher.reader.describe()
            self.observer.set_reader(str(reader.get("reader", searcher.reader_name)), str(reader.get("engine", "")))
            self.observer.set_record_cache(reader.get("record_cache"), reader.get("ram"))  # the split before a search
            self.observer.set_prefetch(searcher.prefetch_estimates)  # the verdict before the first search
            self._start_replication()

    def _start_replication(self) -> None:
        """--follow: a follower (a replica of its partition when it advertises a URL); --publish: a
        fenced writer, which leads while it holds the partition's lease on the store and stands by
        (following) while another process does."""
        config = self.config
        if config.follow is not None:
            self.follower = Follower(config.follow, self.path, config.follow_interval_s,
                                     advertise_url=config.advertise_url or "").start()
        if config.publish is not None:
            self.publisher = FencedWriter(config.publish, self.path, config.publish_interval_s, config.publish_keep,
                                          name=config.writer_name or socket.gethostname(),
                                          advertise_url=config.advertise_url or "", lease_s=config.writer_lease_s,
                                          wait_s=config.write_wait_s, shard_map=config.shard_map).start()

    def warm(self) -> None:
        """In a worker thread: a search, and (unless read-only) the write path's encoder, so that the
        first request is as fast as the next. A write path that cannot warm is the first write's
        to report; searches go on."""
        self._searching().warmup()
        if self.read_only:
            return
        started = time.perf_counter()
        try:
            self._writing().warmup()
            logger.info("write path warmed", extra={"index": self.name, "seconds": round(time.perf_counter() - started, 3)})
        except EspnError as exc:  # the index's own answer to a write (one of precomputed embeddings: no text)
            logger.info("write path not warmed: %s", exc, extra={"index": self.name})
        except Exception:
            logger.warning("the write path could not be warmed; the first write will load it", exc_info=True)

    async def close(self, encoders: SharedEncoders) -> None:
        """Answer what is queued, publish (and upload) what was accepted, close, give back the encoder."""
        if self.searching is not None:
            await self.searching.close()
        if self.writing is not None:
            await asyncio.to_thread(self.writing.close)
            self.writing = None
        for source in (self.follower, self.publisher):
            if source is not None:
                await asyncio.to_thread(source.stop)
        self.follower = self.publisher = None
        if self.live is not None:
            self.documents = self.live.current.searchable_documents
            self.live.close()
        self.live, self.searching = None, None
        self._release_encoder(encoders)
        self.observer.set_index(self.name, False, self.documents)

    # -- internals ----------------------------------------------------------------------

    def _searching(self) -> Searching:
        searching = self.searching
        if searching is None:
            raise UnavailableError(f"index {self.name!r} is not open ({self.life.state.value})", retry_after_s=5)
        return searching

    def _writing(self) -> Writing:
        """This process's writer of the index, made at its first write; ReadOnlyIndexError when it is
        served read-only or follows another server."""
        live = self.live
        if live is None:
            raise UnavailableError(f"index {self.name!r} is not open ({self.life.state.value})", retry_after_s=5)
        if self.config.follow is not None:
            raise ReadOnlyIndexError(f"this server follows {self.config.follow} (a read replica); send writes to the "
                                     "server that publishes there", code="read_only")
        if self.read_only:
            raise ReadOnlyIndexError(f"this server serves {self.path} read-only (--read-only, or the index is on a "
                                     "read-only mount); writes are refused", code="read_only")
        with self._writing_made:  # the warm-up's thread and the first write may ask at once
            if self.writing is None:
                self.writing = Writing(self.path, self.config, lambda generation: self._serve_newest(live),
                                       lambda kind, seconds: self._compacted(live, kind, seconds),
                                       fence=self.publisher)
            return self.writing

    @staticmethod
    def _serve_newest(live: LiveSearcher) -> None:
        """On the publishing thread: this process searches a new generation before its writers hear of it."""
        live.refresh()

    def _compacted(self, live: LiveSearcher, kind: str, seconds: float) -> None:
        """On the compaction's thread: the new base is served (and the old one let go) at once, not
        at the next request."""
        live.refresh()
        self.observer.observe_compaction(self.name, kind, seconds)

    def _decide_read_only(self) -> bool:
        if self.config.follow is not None:  # a follower's index changes only by what it fetches
            return True
        if self.config.read_only is not None:
            return self.config.read_only
        reason = read_only_reason(self.path)
        if reason is not None:
            logger.warning("serving %s read-only: %s; writes are refused", self.path, reason)
        return reason is not None

    def _snapshot_dir(self) -> Path:
        directory = self.config.snapshot_dir
        if directory is None:
            raise NotEnabledError("snapshots over HTTP are off: start the server with --snapshot-dir DIR (or run "
                                  "`espn snapshot INDEX DEST` beside it)", code="snapshots_off")
        return directory

    def _release_encoder(self, encoders: SharedEncoders) -> None:
        if self._encoder_key is not None:
            encoders.release(self._encoder_key)
            self._encoder_key = None


def _snapshot_dir_ready(directory: Path) -> None:
    """The snapshot directory made, and cleared of what killed snapshots left."""
    directory.mkdir(parents=True, exist_ok=True)
    removed = remove_leftovers(directory)
    if removed:
        logger.info("removed leftovers of killed snapshots", extra={"removed": removed})
