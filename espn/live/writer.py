"""Writes to a live index: upserts and deletes, each group of them published as one generation.

`IndexWriter(INDEX)` is the writer; it holds the index's writer lock (`live/LOCK`, an
exclusive `flock`: one writer at a time, in any process) only while it publishes, so
the writers of several server workers and an `espn add` take turns, and the expensive
part of a write (encoding, in memory) runs outside the lock. `IndexWriter.open(INDEX)`
instead holds the lock until `close()` (the command line's one-shot writes).
`espn.live.LiveIndex` is this writer with the index's own side indexes and compaction.

A publish (`publish`): the writes of a group are resolved in order against the current
generation (espn.live.resolve: each caller's write whole or not at all: an unknown id to
delete fails that write only), then
1. the new documents' records are appended to the base's embeddings.bin past the
   published end and fsynced (crash point "appended");
2. their delta segment is written and renamed into place as live/seg-N ("segment");
3. the doc numbers they delete or replace go to one tombstone file, live/tomb-N.npy,
   merged with the small tombstone files before it ("tombstones");
4. each side index (espn.live.side_index.SideIndex, given to the writer: the full-text
   index) writes its own files for this generation;
5. the generation record live/gen-N.json ("generation"), then `live/CURRENT` replaced by
   rename and the directory fsynced ("published").
A `kill -9` anywhere before that rename leaves the previous generation current; the next
writer truncates the unpublished tail of embeddings.bin and removes unpublished files
(espn.live.staging.recover). Per-write work is proportional to the write: a delete writes a
tombstone file of a few bytes and the generation record, never a bitmap over every document.
Compaction (espn.live.compaction) works from a snapshot without this lock and takes it only
to swap its result in. See espn/generation/segments.py for the layout and the reading side.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import threading
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence, TypeVar

import faiss
import numpy as np
from PIL import Image

from espn.ann import load_ivf
from espn.encoders import Encoder, load_encoder
from espn.errors import ConflictError, EspnError, IndexLockedError, InvalidParameterError, ReadOnlyIndexError
from espn.files.clock import utc_now
from espn.files.crash_points import checkpoint
from espn.files.durable import fsync_path, write_json_atomic
from espn.files.locks import flock_within
from espn.corpus import index_title_joiner
from espn.index import read_manifest
from espn.partitioning import PartitionLayout
from ..generation.format import LIVE_DIR, Generation, TombstoneFile, read_current
from ..generation.segments import empty_ivf

from .checks import NewDocument, WriteLimits, WriteRequest, WriteResult, check_write
from .encoding import PAGE_BATCH_SIZE, EncodedDocuments, encode_documents, encode_page_documents
from .resolve import IndexState, gather_kept, resolve_writes
from .segment_files import add_tombstones, write_delta, write_tombstones
from .side_index import SideIndex
from .staging import LOCK_FILE, collect_garbage, recover
from .status import live_stats

__all__ = ["IndexWriter", "WriteFence", "FENCED_FILE"]

log = logging.getLogger(__name__)

W = TypeVar("W", bound="IndexWriter")

#: live/FENCED: this index is published by a fenced writer (espn.live.replication.fenced); a
#: writer without the fence refuses to write to it, since what it committed here would be on no store.
FENCED_FILE = "FENCED"


class WriteFence(Protocol):
    """What stands between a writer and its acknowledgements when the index is published to
    object storage under a lease (espn.live.replication.fenced.FencedWriter)."""

    def admit(self, doc_ids: Sequence[str], layout: PartitionLayout) -> None:
        """Raise if a write of these ids may not be taken now (not the writer; a slot owned elsewhere or moving)."""

    def readmit(self, doc_ids: Sequence[str], layout: PartitionLayout) -> None:
        """`admit` again under the writer lock, just before the write is published: what changed
        since the write was queued (a slot frozen by a reshard) is refused here."""

    def publish(self, root: Path, generation: Generation) -> Generation:
        """Publish the generation (its files written, not yet committed here) to the store, under
        the writer lock; returns it as published (renumbered if its number was taken)."""


class IndexWriter:
    """The writer of a live index. Every publish makes one generation.

    `IndexWriter(root)` takes the writer lock for each publish and releases it after;
    `IndexWriter.open(root)` holds it until `close()` (use as a context manager). A second
    writer anywhere gets IndexLockedError (or waits up to `wait_s`). side_indexes: the
    indexes kept beside the vectors (none by default; espn.live.LiveIndex gives the index's own).
    fence: with one, each generation is published to object storage before it is committed
    here, and a write is admitted only while the fence allows (see WriteFence).
    """

    def __init__(self, root: Path | str, encoder: Encoder | None = None, limits: WriteLimits = WriteLimits(),
                 side_indexes: Sequence[SideIndex] = (), fence: WriteFence | None = None) -> None:
        self.root = Path(root).absolute()
        self.fence = fence
        # read_manifest: a clear error for a path that is no index
        manifest = read_manifest(self.root)
        self.partition = PartitionLayout.from_manifest(manifest)
        # How a title joins its text, as the build encoded the index's passages (manifest `passage`).
        self.title_joiner = index_title_joiner(manifest)
        self._encoder = encoder
        self.limits = limits
        self.side_indexes = list(side_indexes)
        self._lock_fd = -1
        self._held = False  # by open(): kept across publishes
        self._mutex = threading.RLock()  # one publish at a time through this object
        self._state: IndexState | None = None
        self._template: tuple[str, np.ndarray] | None = None  # (base, its IVF with empty lists, serialized)

    @classmethod
    def open(cls: type[W], root: Path | str, wait_s: float = 0.0, encoder: Encoder | None = None,
             limits: WriteLimits = WriteLimits()) -> W:
        """Take the writer lock (waiting up to `wait_s`) and hold it until `close()`."""
        writer = cls(root, encoder, limits)
        writer.hold(wait_s)
        return writer

    def hold(self, wait_s: float = 0.0) -> None:
        """Take the writer lock (waiting up to `wait_s`) and keep it across publishes until `close()`."""
        with self._mutex:
            if not self._held:
                self._acquire(wait_s)
                self._held = True

    def close(self) -> None:
        for index in self.side_indexes:
            index.close()
        if self._held:
            self._held = False
            self._release()

    def __enter__(self: W) -> W:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the writer lock -----------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self, wait_s: float = 0.0) -> Iterator[Generation]:
        """Hold the writer lock for the block (unless this writer holds it already), crash
        leftovers recovered; yields the current generation."""
        with self._mutex:
            if self._lock_fd >= 0:
                yield self.current()
                return
            self._acquire(wait_s)
            try:
                yield self.current()
            finally:
                self._release()

    def recover(self) -> None:
        """Remove what a stopped writer left in live/ (a staging directory whose owner is gone),
        when no other writer holds the lock at this moment (else that writer's own recovery does
        it). An index never written to is left as it is: serving it must not change it."""
        if not self.live_dir.is_dir():
            return
        try:
            with self.locked(0.0):  # taking the writer lock recovers what a dead writer left
                pass
        except IndexLockedError:
            pass

    def _acquire(self, wait_s: float) -> None:
        live = self.live_dir
        try:
            live.mkdir(exist_ok=True)
            fd = os.open(live / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise ReadOnlyIndexError(f"{self.root} is read-only ({exc.strerror}); writes are refused") from None
            raise
        if not flock_within(fd, wait_s):
            os.close(fd)
            raise IndexLockedError(f"{self.root}: another writer holds {live / LOCK_FILE}; one writer at a time")
        self._lock_fd = fd
        try:
            recover(self.root)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- state -----------------------------------------------------------------------
    @property
    def live_dir(self) -> Path:
        return self.root / LIVE_DIR

    def current(self) -> Generation:
        return read_current(self.root)

    def _state_of(self, generation: Generation) -> IndexState:
        if self._state is None or self._state.generation != generation:
            self._state = IndexState(self.root, generation, self._state)
        return self._state

    def encoder(self) -> Encoder:
        if self._encoder is None:
            base = self.root / self.current().base
            self._encoder = load_encoder(base / "encoder", read_manifest(base)["encoder"], device="cpu")
        return self._encoder

    def stats(self) -> dict[str, Any]:
        return live_stats(self.root)

    # -- writes ----------------------------------------------------------------------
    def upsert(self, documents: Sequence[NewDocument]) -> WriteResult:
        return self.apply(upserts=documents)

    def delete(self, doc_ids: Sequence[str]) -> WriteResult:
        """Delete by external id; every id must be live (else DocumentNotFoundError, nothing written)."""
        return self.apply(deletes=doc_ids)

    def apply(self, upserts: Sequence[NewDocument] = (), deletes: Sequence[str] = (), wait_s: float = 0.0) -> WriteResult:
        """Upserts and deletes as one generation: all visible at once, or (on any error) none."""
        request = self.check(upserts, deletes)
        outcome = self.publish([request], [self.encode(upserts)], wait_s)[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def check(self, upserts: Sequence[NewDocument], deletes: Sequence[str]) -> WriteRequest:
        """`check_write`, then that this partition owns every id (WrongPartitionError) and, with a
        fence, that this writer may take the write now."""
        request = check_write(upserts, deletes, self.limits)
        if self.fence is not None:
            self.fence.admit(request.upserts + request.deletes, self.partition)
        else:
            self.partition.check_owned(request.upserts + request.deletes)
        return request

    def encode(self, documents: Sequence[NewDocument], batch_size: int = 32) -> EncodedDocuments | None:
        """Encode documents in memory (no lock needed): what `publish` stores. None for none.

        An index of pages (its encoder's modality "image") takes documents with an image only;
        an index of text, documents without one (ConflictError naming the document). An image
        that does not decode is InvalidParameterError."""
        if not documents:
            return None
        encoder = self.encoder()
        pages = encoder.reads_pages
        for d in documents:  # a conflict with the index, as a metadata field of another type is
            if pages and d.image is None:
                raise ConflictError(f"document {d.doc_id!r}: this index holds pages; give the page as an image "
                                    "(PNG, JPEG or WebP), not text")
            if not pages and d.image is not None:
                raise ConflictError(f"document {d.doc_id!r}: an image, but this index holds text; send its text")
        if pages:
            return encode_page_documents(encoder, [(d.doc_id, d.image, d.title, d.text, d.metadata)  # type: ignore[misc]
                                                   for d in documents], min(batch_size, PAGE_BATCH_SIZE))
        return encode_documents(encoder, [(d.doc_id, d.title, d.text, d.metadata) for d in documents],
                                batch_size, joiner=self.title_joiner)

    def warmup(self) -> None:
        """Load the encoder and encode one document of the index's kind (a passage, or a blank page
        for an index of pages), nothing published: the first write is then as fast as the next."""
        if self.encoder().reads_pages:
            page = io.BytesIO()
            Image.new("RGB", (32, 32), (255, 255, 255)).save(page, format="PNG")
            self.encode([NewDocument("warm-up", image=page.getvalue())])
        else:
            self.encode([NewDocument("warm-up", "a passage that warms the write path")])

    def publish(self, requests: Sequence[WriteRequest], encoded: Sequence[EncodedDocuments | None],
                wait_s: float = 0.0, readmit: bool = True) -> list[WriteResult | Exception]:
        """Publish checked writes (`check_write`) and their encoded documents as one generation.

        The writes apply in order; each one's outcome is a WriteResult, or the error that
        made it fail alone (DocumentNotFoundError, InvalidParameterError; with a fence, what
        its `readmit` refuses) while the others publish. Takes the writer lock for the publish
        only (waiting up to `wait_s`). readmit False: the writer's own moves (a reshard's)."""
        if len(requests) != len(encoded):
            raise InvalidParameterError("publish: one encoding (or None) per write")
        self.refuse_unfenced()
        with self.locked(wait_s) as current:
            refused = self._readmit(requests) if readmit else {}
            kept = [r for r in range(len(requests)) if r not in refused]
            state = self._state_of(current)
            resolved = resolve_writes(state, [requests[r] for r in kept], self.limits)
            number = current.number
            if resolved.keep or len(resolved.tombstones):
                documents = gather_kept([encoded[r] for r in kept], resolved.keep) if resolved.keep else None
                try:
                    number = self._publish(current, state, documents, resolved.tombstones)
                except BaseException:
                    self._remove_unpublished()
                    raise
        outcomes: list[WriteResult | Exception] = [refused.get(r, WriteResult(number)) for r in range(len(requests))]
        for r, outcome in zip(kept, resolved.outcomes):
            outcomes[r] = outcome if isinstance(outcome, Exception) else WriteResult(number, *outcome)
        return outcomes

    def _readmit(self, requests: Sequence[WriteRequest]) -> dict[int, Exception]:
        """The writes the fence refuses now, by position (none without a fence)."""
        refused: dict[int, Exception] = {}
        if self.fence is not None:
            for r, request in enumerate(requests):
                try:
                    self.fence.readmit(request.upserts + request.deletes, self.partition)
                except EspnError as exc:
                    refused[r] = exc
        return refused

    def _publish(self, current: Generation, state: IndexState, documents: EncodedDocuments | None,
                 tombstones: np.ndarray) -> int:
        number = current.number + 1
        segments, embeddings_bytes = list(current.segments), current.embeddings_bytes
        if documents is not None:
            info = write_delta(self.live_dir, number, current, state, documents, self.empty_ivf)
            segments.append(info)
            embeddings_bytes = info.records[-1].stop
        chain = add_tombstones(self.live_dir, current.tombstones, tombstones, number)
        side = self._side_on_write(current, number, current.total, documents, tombstones)
        return self.commit(Generation(number, current.base, current.base_documents, embeddings_bytes,
                                      tuple(segments), chain, utc_now(), current.base_files, side)).number

    def _remove_unpublished(self) -> None:
        """After a publish that failed (a full disk, an I/O error), under the writer lock: what it
        wrote goes now (its segment, tombstones, side files, the records past the published end),
        not at the next write, so that the space is free again and nothing of it outlives the error."""
        try:
            removed = recover(self.root)
        except Exception as exc:  # noqa: BLE001 - the publish's own error is the one to report
            log.warning("%s: could not remove what the failed write left (%s); the next writer will", self.root, exc)
            return
        if removed:
            log.info("removed what the failed write left: %s", ", ".join(removed))

    def empty_ivf(self, base: str) -> faiss.IndexIVF:
        """A new IVF with the base's trained quantizer and empty lists (the base's lists are never copied)."""
        if self._template is None or self._template[0] != base:
            self._template = (base, faiss.serialize_index(empty_ivf(load_ivf(self.root / base / "ann.faiss"))))
        index = faiss.deserialize_index(self._template[1])
        ivf = faiss.extract_index_ivf(index)
        ivf.referenced_objects = [index]  # type: ignore[attr-defined]
        return ivf

    def write_tombstones(self, numbers: np.ndarray, number: int) -> TombstoneFile:
        """live/tomb-NNNNNN.npy holding `numbers` (sorted int64), fsynced."""
        return write_tombstones(self.live_dir, numbers, number)

    def _side_on_write(self, current: Generation, number: int, first: int, documents: EncodedDocuments | None,
                       tombstones: np.ndarray) -> dict[str, Any]:
        side = dict(current.side)
        for index in self.side_indexes:
            side[index.name] = dict(index.on_write(self.live_dir, number, current.side.get(index.name), first,
                                                   documents, tombstones))
        return side

    def refuse_unfenced(self) -> None:
        """ReadOnlyIndexError when a fenced writer publishes this index and this writer has no fence."""
        if self.fence is None and (self.live_dir / FENCED_FILE).exists():
            raise ReadOnlyIndexError(f"{self.root} is published to object storage by a fenced writer (`espn serve "
                                     "--publish`): write through that server, so that what is written is on the store")

    def commit(self, generation: Generation, fetched: bool = False) -> Generation:
        """Publish (under the writer lock): the generation file, then CURRENT by rename; both
        fsynced, then the directory. Then files no held generation needs are removed.

        With a fence, the generation goes to object storage first (it may come back renumbered)
        and is committed here only once it is published there; if that fails nothing is
        committed and the staged files are removed at once. `fetched`: a generation a follower
        fetched from the store (published already). Returns the generation as committed."""
        if not fetched:
            self.refuse_unfenced()
        if self.fence is not None and not fetched:
            try:
                generation = self.fence.publish(self.root, generation)
            except BaseException:
                recover(self.root)  # what this publish staged goes now, not at the next writer's lock
                raise
        write_json_atomic(self.live_dir / generation.file_name, generation.to_json())
        checkpoint("generation")
        tmp = self.live_dir / "CURRENT.tmp"
        with open(tmp, "w") as f:
            f.write(generation.file_name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.live_dir / "CURRENT")
        fsync_path(self.live_dir)
        checkpoint("published")
        log.info("published generation %d (%d segments, %d live documents)", generation.number,
                 len(generation.segments), generation.live_documents)
        self.collect_garbage()
        return generation

    def collect_garbage(self) -> list[str]:
        """Remove the files of generations no reader holds (their shared lock); returns what went.
        Under the writer lock."""
        return collect_garbage(self.root)
