"""Writes to a live index: upserts and deletes, each group of them published as one generation.

`LiveIndex(INDEX)` is the writer; it holds the index's writer lock (`live/LOCK`, an
exclusive `flock`: one writer at a time, in any process) only while it publishes, so
the writers of several server workers and an `espn add` take turns, and the expensive
part of a write (encoding, in memory) runs outside the lock. `LiveIndex.open(INDEX)`
instead holds the lock until `close()` (the command line's one-shot writes).

A publish (`publish`): the writes of a group are resolved in order against the current
generation (each caller's write whole or not at all: an unknown id to delete fails that
write only), then
1. the new documents' records are appended to the base's embeddings.bin past the
   published end and fsynced (`_checkpoint("appended")`);
2. their delta segment is written and renamed into place as live/seg-N ("segment");
3. the doc numbers they delete or replace go to one tombstone file, live/tomb-N.npy,
   merged with the small tombstone files before it ("tombstones");
4. each side index (`SideIndex`: the full-text index of a later issue) writes its own
   files for this generation: the one place such an index plugs in;
5. the generation record live/gen-N.json ("generation"), then `live/CURRENT` replaced by
   rename and the directory fsynced ("published").
A `kill -9` anywhere before that rename leaves the previous generation current; the next
writer truncates the unpublished tail of embeddings.bin and removes unpublished files
(`_recover`). Per-write work is proportional to the write: a delete writes a tombstone
file of a few bytes and the generation record, never a bitmap over every document.
Compaction (indexing/compaction.py) works from a snapshot without this lock and takes
it only to swap its result in. See espn/segments.py for the layout and the reading side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import faiss
import numpy as np

from espn.ann import load_ivf
from espn.encoders import Encoder, load_encoder
from espn.errors import ConflictError, CorpusError, DocumentNotFoundError, IndexLockedError, InvalidParameterError, \
    ReadOnlyIndexError
from espn.ids import MAX_ID_BYTES, check_doc_id
from espn.index import FILES, OPTIONAL_FILES, IdMap, IndexDirectory, fsync_path, read_manifest, sha256_file, write_json_atomic
from espn.metadata import DEFAULT_LIMITS, MetadataLimits, MetadataWriter, add_from_passages, check_field_count, \
    check_metadata, merge_types, value_type
from espn.metadata import DIRECTORY as METADATA_DIR
from espn.partitioning import PartitionLayout
from espn.pooling_groups import present_group_files
from espn.segments import (
    LIVE_DIR,
    SEGMENT_FILES,
    ByteRange,
    Generation,
    SegmentInfo,
    TombstoneFile,
    empty_ivf,
    generation_schema,
    read_current,
    read_generation,
    read_tombstones,
)
from espn.store.format import RecordWriter, StoreLayout

from .chunks import finished_chunks, read_chunk
from .encode import EncodedDocuments, encode_corpus, encode_documents
from .scan import scan_corpus

__all__ = ["LiveIndex", "NewDocument", "WriteRequest", "WriteResult", "WriteLimits", "SideIndex", "IndexLockedError",
           "check_write", "live_stats", "iter_ids_file", "read_only_reason", "MAX_ID_BYTES", "MAX_TEXT_CHARS", "Staging"]

log = logging.getLogger(__name__)

#: Longest passage (title and text, characters) a write accepts.
MAX_TEXT_CHARS = 100_000
#: A tombstone file is merged into the next one while the result stays this small (entries),
#: so a chain of single deletes costs a few small files, not one file per delete.
TOMBSTONE_MERGE_MAX = 8192


@dataclasses.dataclass(frozen=True)
class NewDocument:
    """A document to upsert; metadata is stored with the passage (a JSON object)."""

    doc_id: str
    text: str
    title: str = ""
    metadata: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class WriteResult:
    """What a publish did: created / replaced / deleted external ids, the new generation."""

    generation: int
    created: list[str] = dataclasses.field(default_factory=list)
    replaced: list[str] = dataclasses.field(default_factory=list)
    deleted: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class WriteLimits:
    """What one write may hold (checked before anything is encoded or written)."""

    metadata: MetadataLimits = DEFAULT_LIMITS
    max_text_chars: int = MAX_TEXT_CHARS


@dataclasses.dataclass(frozen=True)
class WriteRequest:
    """One caller's write, checked: the ids it upserts (in order) and deletes, and the metadata
    fields its documents carry (name -> type). Published whole or not at all."""

    upserts: tuple[str, ...]
    deletes: tuple[str, ...]
    fields: Mapping[str, str] = dataclasses.field(default_factory=dict)


def check_write(upserts: Sequence[NewDocument], deletes: Sequence[str], limits: WriteLimits = WriteLimits()) -> WriteRequest:
    """Validate a write before anything is encoded or written; InvalidParameterError naming
    the document and the problem (ids: espn.ids; text length; metadata and its limits)."""
    if not upserts and not deletes:
        raise InvalidParameterError("nothing to write: give documents to upsert or ids to delete")
    seen: set[str] = set()
    fields: dict[str, str] = {}
    for i, d in enumerate(upserts):
        check_doc_id(d.doc_id, f"document {i}: id")
        if d.doc_id in seen:
            raise ConflictError(f"document id {d.doc_id!r} appears twice in one write")
        seen.add(d.doc_id)
        if not isinstance(d.text, str) or not isinstance(d.title, str):
            raise InvalidParameterError(f"document {d.doc_id!r}: title and text must be strings")
        if not (d.text.strip() or d.title.strip()):
            raise InvalidParameterError(f"document {d.doc_id!r}: text is empty")
        if len(d.text) + len(d.title) > limits.max_text_chars:
            raise InvalidParameterError(f"document {d.doc_id!r}: title and text hold {len(d.text) + len(d.title)} "
                                        f"characters; at most {limits.max_text_chars}")
        try:
            metadata = check_metadata(d.metadata if d.metadata is None else dict(d.metadata), limits.metadata)
            for name, value in metadata.items():
                kind = merge_types(fields.get(name), value_type(value))
                if kind is not None:
                    fields[name] = kind
            check_field_count(fields, limits.metadata)
        except ValueError as exc:
            raise InvalidParameterError(f"document {d.doc_id!r}: {exc}") from None
    for doc_id in deletes:
        check_doc_id(doc_id, "id to delete")
    if len(set(deletes)) != len(deletes):
        raise ConflictError("delete lists an id twice")
    both = seen.intersection(deletes)
    if both:
        raise ConflictError(f"id {sorted(both)[0]!r} is both upserted and deleted in one write")
    return WriteRequest(tuple(d.doc_id for d in upserts), tuple(deletes), fields)


class SideIndex(Protocol):
    """An index kept beside the vectors that moves with every generation (a full-text index).

    The writer calls it at fixed points, under the writer lock, before the generation
    record is written; whatever it returns is that generation's `side[name]` entry, whose
    `files` ({path under live/: {"bytes", "sha256"}}) the generation then names (kept by the
    garbage collector while a held generation names them; numbered names like
    `text-000012/` are removed when unpublished after a crash). Deleted or replaced doc
    numbers must never match again; doc numbers are those of espn.segments.
    """

    name: str

    def on_write(self, live_dir: Path, number: int, previous: Mapping[str, Any] | None, first: int,
                 documents: EncodedDocuments | None, tombstones: np.ndarray) -> Mapping[str, Any]:
        """Generation `number` adds `documents` at doc numbers first.. and deletes `tombstones`."""

    def on_swap(self, live_dir: Path, number: int, previous: Mapping[str, Any] | None,
                renumber: Callable[[np.ndarray], np.ndarray], source: Any = None) -> Mapping[str, Any]:
        """A compaction swaps in generation `number`: doc numbers of the generation before map
        through `renumber` (-1: dropped); the identity for a merge of deltas (source None). A base
        rewrite also gives its `text_side.SwapSource`: the new base, the carried segments, the deletes."""

    def close(self) -> None:
        """Release what it holds between writes (the writer closes)."""


def flock_within(fd: int, wait_s: float, longest_pause_s: float = 0.01) -> bool:
    """Take an exclusive flock on `fd`, polling for up to `wait_s` (flock itself cannot time
    out); False when another holder kept it that long."""
    deadline = time.monotonic() + wait_s
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, longest_pause_s)


def _own_side_indexes(root: Path) -> list[SideIndex]:
    from .text_side import TextSide, text_config_of

    config = text_config_of(root / read_current(root).base)
    return [] if config is None else [TextSide(config)]


#: Test hook: called with a step name at each point a crash test kills the writer.
_checkpoint: Callable[[str], None] = lambda step: None

_NUMBERED = re.compile(r"^([a-z]+)-(\d{6})(?:\.[a-z]+)?$")


def file_entry(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def fsync_tree(directory: Path) -> None:
    """fsync every file under `directory`, then the directories themselves (bottom up)."""
    for path in sorted(directory.rglob("*"), key=lambda p: -len(p.parts)):
        fsync_path(path)
    fsync_path(directory)


class Staging:
    """A work directory under live/ that survives the writers' crash recovery while its owner
    lives: the owner holds an `flock` on it, and `_recover` removes a staging directory only
    when it can take that lock (its owner died). For `espn add`'s encoding and compaction,
    which run without the writer lock; it is made under that lock (briefly), so that no
    recovery sees it before it is locked."""

    PREFIXES = ("stage-",)

    def __init__(self, writer: "LiveIndex", kind: str, wait_s: float) -> None:
        with writer.locked(wait_s):
            self._make(writer.live_dir, kind)

    @classmethod
    def under_lock(cls, live_dir: Path, kind: str) -> "Staging":
        """For a caller that holds the writer lock already (a side index, in a publish)."""
        staging = cls.__new__(cls)
        staging._make(live_dir, kind)
        return staging

    def _make(self, live_dir: Path, kind: str) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=f"stage-{kind}-", dir=live_dir))
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __enter__(self) -> "Staging":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._fd)
            self._fd = -1


class _IndexState:
    """What a writer needs of the current generation to resolve ids: every segment's id map
    (memory-mapped, holding no descriptor) and the tombstones; rebuilt per generation,
    sharing the unchanged maps with the one before."""

    def __init__(self, root: Path, generation: Generation, previous: "_IndexState | None") -> None:
        self.generation = generation
        reuse = previous if previous is not None and previous.generation.base == generation.base else None
        self.base: IndexDirectory = reuse.base if reuse is not None else \
            IndexDirectory(root / generation.base, read_manifest(root / generation.base))
        maps = {} if reuse is None else reuse.maps
        self.maps: dict[str, IdMap] = {".": maps.get(".") or IdMap(self.base.load_array("ids.npy"),
                                                                   self.base.load_array("ids_sorted.npy"))}
        for info in generation.segments:
            seg = IndexDirectory(root / LIVE_DIR / info.name, {})
            self.maps[info.name] = maps.get(info.name) or IdMap(seg.load_array("ids.npy"),
                                                                seg.load_array("ids_sorted.npy"))
        self.firsts = [(0, ".")] + [(info.first, info.name) for info in generation.segments]
        self.tombstones = read_tombstones(root, generation)
        self.schema = generation_schema(self.base, generation)

    def live_number(self, doc_id: str) -> int | None:
        """The doc number of the live version of `doc_id`, None when it is absent or deleted."""
        for first, name in reversed(self.firsts):  # the newest version is the only one that can be live
            try:
                number = first + self.maps[name].internal(doc_id)
            except DocumentNotFoundError:
                continue
            at = int(np.searchsorted(self.tombstones, number))
            return None if at < len(self.tombstones) and self.tombstones[at] == number else number
        return None


@dataclasses.dataclass
class _Resolved:
    """A group resolved in order: per write its outcome, the documents to store, the doc numbers to tombstone."""

    outcomes: list[tuple[list[str], list[str], list[str]] | Exception]
    keep: list[tuple[int, int]]  # (write, document) of the documents stored, in order
    tombstones: np.ndarray


def _resolve(state: _IndexState, requests: Sequence[WriteRequest], limits: WriteLimits) -> _Resolved:
    """Apply the writes in order, as if one after the other: each sees the ones before it.
    A write that deletes an id that is not there, or gives a metadata field a type the index
    holds another type for, fails alone; a document upserted twice in the group is stored once."""
    pending: dict[str, tuple[str, int] | None] = {}  # id -> ("old", doc number) | ("new", slot) | None
    slots: list[tuple[int, int]] = []
    alive: set[int] = set()
    dead: list[int] = []
    schema = dict(state.schema)
    outcomes: list[tuple[list[str], list[str], list[str]] | Exception] = []

    def where(doc_id: str) -> tuple[str, int] | None:
        if doc_id in pending:
            return pending[doc_id]
        number = state.live_number(doc_id)
        return None if number is None else ("old", number)

    def drop(location: tuple[str, int] | None) -> None:
        if location is None:
            return
        kind, value = location
        if kind == "old":
            dead.append(value)
        else:
            alive.discard(value)

    for r, request in enumerate(requests):
        missing = [doc_id for doc_id in request.deletes if where(doc_id) is None]
        if missing:
            outcomes.append(DocumentNotFoundError(f"no document with id {missing[0]!r}"))
            continue
        try:
            merged = dict(schema)
            for name, kind in request.fields.items():
                try:
                    merged[name] = merge_types(merged.get(name), kind) or kind
                except ValueError as exc:  # the index holds this field with another type
                    raise ConflictError(f"metadata field {name!r} {exc}") from None
            check_field_count(merged, limits.metadata)
        except ConflictError as exc:
            outcomes.append(exc)
            continue
        except ValueError as exc:
            outcomes.append(InvalidParameterError(str(exc)))
            continue
        schema = merged
        created: list[str] = []
        replaced: list[str] = []
        for doc_id in request.deletes:
            drop(where(doc_id))
            pending[doc_id] = None
        for i, doc_id in enumerate(request.upserts):
            location = where(doc_id)
            (replaced if location is not None else created).append(doc_id)
            drop(location)
            alive.add(len(slots))
            pending[doc_id] = ("new", len(slots))
            slots.append((r, i))
        outcomes.append((created, replaced, list(request.deletes)))
    keep = [slots[s] for s in sorted(alive)]
    return _Resolved(outcomes, keep, np.unique(np.asarray(dead, dtype=np.int64)))


def _gather(encoded: Sequence[EncodedDocuments | None], keep: Sequence[tuple[int, int]]) -> EncodedDocuments:
    """The kept (write, document) pairs of a group, in order, as one EncodedDocuments."""
    parts = []
    for r in sorted({r for r, _ in keep}):
        part = encoded[r]
        assert part is not None, "a write with upserts was encoded"
        parts.append(part.take([i for w, i in keep if w == r]))
    return parts[0] if len(parts) == 1 else EncodedDocuments.concat(parts)


class LiveIndex:
    """The writer of a live index. Every publish makes one generation.

    `LiveIndex(root)` takes the writer lock for each publish and releases it after;
    `LiveIndex.open(root)` holds it until `close()` (use as a context manager). A second
    writer anywhere gets IndexLockedError (or waits up to `wait_s`).
    """

    def __init__(self, root: Path | str, encoder: Encoder | None = None, limits: WriteLimits = WriteLimits(),
                 side_indexes: Sequence[SideIndex] | None = None) -> None:
        self.root = Path(root).absolute()
        # read_manifest: a clear error for a path that is no index
        self.partition = PartitionLayout.from_manifest(read_manifest(self.root))
        self._encoder = encoder
        self.limits = limits
        # By default the side indexes the index has: its full-text index, when its base has one.
        self.side_indexes = list(side_indexes) if side_indexes is not None else _own_side_indexes(self.root)
        self._lock_fd = -1
        self._held = False  # by open(): kept across publishes
        self._mutex = threading.RLock()  # one publish at a time through this object
        self._state: _IndexState | None = None
        self._template: tuple[str, np.ndarray] | None = None  # (base, its IVF with empty lists, serialized)

    @classmethod
    def open(cls, root: Path | str, wait_s: float = 0.0, encoder: Encoder | None = None,
             limits: WriteLimits = WriteLimits()) -> "LiveIndex":
        """Take the writer lock (waiting up to `wait_s`) and hold it until `close()`."""
        writer = cls(root, encoder, limits)
        writer._acquire(wait_s)
        writer._held = True
        return writer

    def close(self) -> None:
        for index in self.side_indexes:
            index.close()
        if self._held:
            self._held = False
            self._release()

    def __enter__(self) -> "LiveIndex":
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

    def _acquire(self, wait_s: float) -> None:
        live = self.live_dir
        try:
            live.mkdir(exist_ok=True)
            fd = os.open(live / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise ReadOnlyIndexError(f"{self.root} is read-only ({exc.strerror}); writes are refused") from None
            raise
        if not flock_within(fd, wait_s):
            os.close(fd)
            raise IndexLockedError(f"{self.root}: another writer holds {live / 'LOCK'}; one writer at a time")
        self._lock_fd = fd
        try:
            self._recover()
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

    def _state_of(self, generation: Generation) -> _IndexState:
        if self._state is None or self._state.generation != generation:
            self._state = _IndexState(self.root, generation, self._state)
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
        """`check_write`, then that this partition owns every id (WrongPartitionError)."""
        request = check_write(upserts, deletes, self.limits)
        self.partition.check_owned(request.upserts + request.deletes)
        return request

    def encode(self, documents: Sequence[NewDocument], batch_size: int = 32) -> EncodedDocuments | None:
        """Encode documents in memory (no lock needed): what `publish` stores. None for none."""
        if not documents:
            return None
        return encode_documents(self.encoder(), [(d.doc_id, d.title, d.text, d.metadata) for d in documents],
                                batch_size)

    def publish(self, requests: Sequence[WriteRequest], encoded: Sequence[EncodedDocuments | None],
                wait_s: float = 0.0) -> list[WriteResult | Exception]:
        """Publish checked writes (`check_write`) and their encoded documents as one generation.

        The writes apply in order; each one's outcome is a WriteResult, or the error that
        made it fail alone (DocumentNotFoundError, InvalidParameterError) while the others
        publish. Takes the writer lock for the publish only (waiting up to `wait_s`).
        """
        if len(requests) != len(encoded):
            raise InvalidParameterError("publish: one encoding (or None) per write")
        with self.locked(wait_s) as current:
            state = self._state_of(current)
            resolved = _resolve(state, requests, self.limits)
            number = current.number
            if resolved.keep or len(resolved.tombstones):
                number = self._publish(current, state, _gather(encoded, resolved.keep) if resolved.keep else None,
                                       resolved.tombstones)
        return [o if isinstance(o, Exception) else WriteResult(number, *o) for o in resolved.outcomes]

    def _publish(self, current: Generation, state: _IndexState, documents: EncodedDocuments | None,
                 tombstones: np.ndarray) -> int:
        number = current.number + 1
        segments, embeddings_bytes = list(current.segments), current.embeddings_bytes
        if documents is not None:
            info = self._write_delta(number, current, state, documents)
            segments.append(info)
            embeddings_bytes = info.records[-1].stop
        chain = self._add_tombstones(current.tombstones, tombstones, number)
        side = self._side_on_write(current, number, current.total, documents, tombstones)
        self.commit(Generation(number, current.base, current.base_documents, embeddings_bytes, tuple(segments),
                               chain, _now(), current.base_files, side))
        return number

    def add_corpus(self, corpus: Path, *, batch_size: int = 32, loader_workers: int = 1, progress: bool = False,
                   skip_bad: bool = False, wait_s: float = 0.0) -> WriteResult:
        """Upsert every document of a corpus file (BEIR jsonl or TSV) as one generation.

        Encoding runs without the writer lock (into chunk files of a staging directory, as
        the build does), so writers of a running server are not held up; the lock is taken
        (waiting up to `wait_s`) only to publish.
        """
        corpus = Path(corpus)
        if not corpus.is_file():
            raise CorpusError(f"{corpus}: no such file")
        scan = scan_corpus(corpus, skip_bad)  # ids valid and unique, lines valid, before any encoding
        if scan.documents == 0:
            raise CorpusError(f"{corpus}: the corpus has no documents")
        with Staging(self, "add", wait_s) as work:
            encode_corpus(corpus, work.path, self.encoder(), batch_size=batch_size, loader_workers=loader_workers,
                          progress=progress, skip_bad=skip_bad, total_documents=scan.documents)
            _checkpoint("encoded")
            parts = [EncodedDocuments.from_chunk(read_chunk(work.path, c)) for c in finished_chunks(work.path)]
            documents = EncodedDocuments.concat(parts)
            self.partition.check_owned(documents.ids)
            try:
                check_field_count(scan.metadata_fields, self.limits.metadata)
            except ValueError as exc:
                raise CorpusError(f"{corpus}: {exc}") from None
            outcome = self.publish([WriteRequest(tuple(documents.ids), (), scan.metadata_fields)], [documents],
                                   wait_s)[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _write_delta(self, number: int, current: Generation, state: _IndexState,
                     documents: EncodedDocuments) -> SegmentInfo:
        """Records appended to the base's embeddings.bin; the rest in live/seg-NNNNNN."""
        base = state.base
        layout = StoreLayout.from_manifest(base.manifest["store"])  # pooling and storage type as the build's
        n = len(documents)
        name = f"seg-{number:06d}"
        staging = self.live_dir / f"{name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        first = current.total
        writer = MetadataWriter(staging, n)
        add_from_passages(writer, documents.lines)
        columns = writer.finish()
        start = current.embeddings_bytes
        # Truncates any unpublished tail first (a crashed writer's), then appends block-aligned.
        with RecordWriter(base.file("embeddings.bin"), layout, resume_at=start, groups_dir=staging) as records_out:
            records = records_out.append(documents.cls, documents.bow, documents.counts)
            stop = records_out.close()
        _checkpoint("appended")
        ids = np.array([i.encode("utf-8") for i in documents.ids], dtype=bytes)
        np.save(staging / "records.npy", records)
        np.save(staging / "ids.npy", ids)
        np.save(staging / "ids_sorted.npy", np.argsort(ids, kind="stable"))
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(line) for line in documents.lines], out=offsets[1:])
        (staging / "docs.jsonl").write_bytes(b"".join(documents.lines))
        np.save(staging / "docs_offsets.npy", offsets)
        ann = self.empty_ivf(current.base)
        ann.add_with_ids(np.ascontiguousarray(documents.cls, dtype=np.float32), np.arange(first, first + n, dtype=np.int64))
        faiss.write_index(ann, str(staging / "ann.faiss"))
        fsync_tree(staging)
        final = self.live_dir / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        fsync_path(self.live_dir)
        _checkpoint("segment")
        column_files = sorted(str(p.relative_to(final)) for p in (final / METADATA_DIR).glob("*.npy"))
        group_files = present_group_files(final)  # pooling groups (espn.pooling_groups), when records are pooled
        files = {f: file_entry(final / f) for f in [*SEGMENT_FILES, *column_files, *group_files]}
        return SegmentInfo(name, first, n, files, (ByteRange(start, stop, sha256_file(base.file("embeddings.bin"), start, stop)),),
                           columns)

    def empty_ivf(self, base: str) -> faiss.IndexIVF:
        """A new IVF with the base's trained quantizer and empty lists (the base's lists are never copied)."""
        if self._template is None or self._template[0] != base:
            self._template = (base, faiss.serialize_index(empty_ivf(load_ivf(self.root / base / "ann.faiss"))))
        index = faiss.deserialize_index(self._template[1])
        ivf = faiss.extract_index_ivf(index)
        ivf.referenced_objects = [index]  # type: ignore[attr-defined]
        return ivf

    def _add_tombstones(self, chain: Sequence[TombstoneFile], numbers: np.ndarray, number: int) -> tuple[TombstoneFile, ...]:
        """A tombstone file for `numbers` (deleted or replaced doc numbers), merged with the
        newest files while they are no larger than it and the result stays small: a chain of
        single deletes leaves O(log n) files, and each delete writes a few bytes."""
        if len(numbers) == 0:
            return tuple(chain)
        chain = list(chain)
        merged = np.asarray(numbers, dtype=np.int64)
        while chain and chain[-1].count <= len(merged) and chain[-1].count + len(merged) <= TOMBSTONE_MERGE_MAX:
            older = np.load(self.live_dir / chain.pop().file, allow_pickle=False)
            merged = np.union1d(older, merged)
        return (*chain, self.write_tombstones(merged, number))

    def write_tombstones(self, numbers: np.ndarray, number: int) -> TombstoneFile:
        """live/tomb-NNNNNN.npy holding `numbers` (sorted int64), fsynced."""
        name = f"tomb-{number:06d}.npy"
        path = self.live_dir / name
        with open(path, "wb") as f:
            np.save(f, np.sort(np.asarray(numbers, dtype=np.int64)))
            f.flush()
            os.fsync(f.fileno())
        _checkpoint("tombstones")
        entry = file_entry(path)
        return TombstoneFile(name, len(numbers), entry["bytes"], entry["sha256"])

    def _side_on_write(self, current: Generation, number: int, first: int, documents: EncodedDocuments | None,
                       tombstones: np.ndarray) -> dict[str, Any]:
        side = dict(current.side)
        for index in self.side_indexes:
            side[index.name] = dict(index.on_write(self.live_dir, number, current.side.get(index.name), first,
                                                   documents, tombstones))
        return side

    def commit(self, generation: Generation) -> None:
        """Publish (under the writer lock): the generation file, then CURRENT by rename; both
        fsynced, then the directory. Then files no held generation needs are removed."""
        write_json_atomic(self.live_dir / generation.file_name, generation.to_json())
        _checkpoint("generation")
        tmp = self.live_dir / "CURRENT.tmp"
        with open(tmp, "w") as f:
            f.write(generation.file_name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.live_dir / "CURRENT")
        fsync_path(self.live_dir)
        _checkpoint("published")
        log.info("published generation %d (%d segments, %d live documents)", generation.number,
                 len(generation.segments), generation.live_documents)
        self.collect_garbage()

    # -- compaction (indexing/compaction.py) ------------------------------------------------
    def compact(self, wait_s: float = 0.0) -> WriteResult:
        """Rewrite the base from every segment's live documents (deleted ones dropped), from a
        snapshot: writes go on meanwhile and are carried over at the swap, which waits up to
        `wait_s` for the writer lock (as does the wait for another compaction)."""
        from .compaction import Plan, run_compaction

        number = run_compaction(self, Plan("rewrite"), wait_s=wait_s, compaction_wait_s=wait_s)
        return WriteResult(self.current().number if number is None else number)

    def maintain(self, policy: Any, wait_s: float = 10.0, swap: Callable[[Callable[[], int]], int] | None = None) -> int | None:
        """Run the compaction `policy` (a compaction.CompactionPolicy) asks for now, if any; the
        generation it published, or None. CompactionRunningError when another one runs.
        swap: what runs its swap (compaction.run_compaction)."""
        from .compaction import run_compaction

        return run_compaction(self, None, policy, wait_s=wait_s, swap=swap)

    # -- recovery and garbage ------------------------------------------------------------
    def _recover(self) -> None:
        """Undo what a crashed writer left unpublished (under the writer lock): staging
        directories, files of unpublished generations, and records appended past the
        published end of embeddings.bin. Staging of a live compaction or `espn add` is kept."""
        current = self.current()
        for path in self.live_dir.iterdir():
            name = path.name
            match = _NUMBERED.match(name)
            if name.endswith(".tmp") or name == "incoming" or (match is not None and int(match[2]) > current.number):
                _remove(path)
            elif name.startswith(Staging.PREFIXES) and _unused(path):
                _remove(path)
        embeddings = self.root / current.base / "embeddings.bin"
        if embeddings.stat().st_size > current.embeddings_bytes:
            with open(embeddings, "r+b") as f:
                f.truncate(current.embeddings_bytes)
                os.fsync(f.fileno())
        self.collect_garbage()

    def collect_garbage(self) -> list[str]:
        """Remove the files of generations no reader holds (their shared lock); returns what went."""
        current = self.current()
        kept: list[Generation] = [current]
        for path in sorted(self.live_dir.glob("gen-*.json")):
            match = _NUMBERED.match(path.name)
            if match is None or int(match[2]) >= current.number:
                continue
            if not _remove_if_unused(path):
                try:
                    kept.append(read_generation(path))
                except Exception:  # noqa: BLE001 - unreadable: keep what it may need, collect it later
                    log.warning("cannot read %s; keeping every file until it goes", path)
                    return []
        referenced = set().union(*(g.referenced() for g in kept))
        root_in_use = "." in referenced or not _unused(self.root / "manifest.json")
        removed = []
        for path in self.live_dir.iterdir():
            match = _NUMBERED.match(path.name)
            if match is None or match[1] == "gen" or int(match[2]) > current.number:
                continue
            if f"{LIVE_DIR}/{path.name}" not in referenced:
                _remove(path)
                removed.append(f"{LIVE_DIR}/{path.name}")
        if not root_in_use:
            for file in (*FILES, *OPTIONAL_FILES):
                if (self.root / file).exists():
                    (self.root / file).unlink()
                    removed.append(file)
            if (self.root / METADATA_DIR).is_dir():  # the first base's columns
                shutil.rmtree(self.root / METADATA_DIR)
                removed.append(METADATA_DIR)
        if removed:
            fsync_path(self.live_dir)
            log.info("removed %s", ", ".join(removed))
        return removed


def _remove(path: Path) -> None:
    """Remove a file or a tree; gone already is fine (a staging directory's owner removes it
    itself, without the writer lock, between our listing of live/ and this call)."""
    try:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    except FileNotFoundError:
        pass


def _remove_if_unused(path: Path) -> bool:
    """Unlink a generation file unless a reader holds it; under the exclusive lock, so a reader
    locking it afterwards finds it gone and opens the current one instead."""
    return _unused(path, unlink=True)


def _unused(path: Path, unlink: bool = False) -> bool:
    """True when no one holds a lock on `path` (a file or a directory; the lock is taken and
    dropped at once; with `unlink`, the file is removed while the lock is held)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if unlink:
            path.unlink()
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def read_only_reason(root: Path | str) -> str | None:
    """Why a writer could not write the index at `root` from this process (a read-only mount,
    no permission), or None when it can."""
    root = Path(root)
    current = read_current(root)
    live_dir = root / LIVE_DIR
    for target in (live_dir if live_dir.is_dir() else root, root / current.base / "embeddings.bin"):
        if os.statvfs(target).f_flag & os.ST_RDONLY:
            return f"{target} is on a read-only filesystem"
        if not os.access(target, os.W_OK):
            return f"{target} is not writable by this user"
    return None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def iter_ids_file(path: Path) -> Iterator[str]:
    """Ids one per line (blank lines skipped; nothing else is stripped), for `espn delete --ids-file`."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:  # invalid UTF-8 is refused by name later
        for line in f:
            doc_id = line.rstrip("\r\n")
            if doc_id.strip():
                yield doc_id


#: Above this many documents added since the encoder state was fitted (a fraction of the
#: base it was fitted on), `stats` recommends a rebuild.
DRIFT_REBUILD = 0.5


def live_stats(root: Path | str) -> dict[str, Any]:
    """Counts per segment, deleted documents, and drift: documents added since the encoder
    state (model, PCA, IVF centroids) was fitted, as a fraction of the base. Needs no lock."""
    root = Path(root)
    g = read_current(root)
    fitted_on = int(read_manifest(root)["counts"]["documents"])  # the first build fitted the encoder state
    carried = int(read_manifest(root / g.base).get("compacted", {}).get("added_since_fit", 0))
    added = carried + g.total - g.base_documents
    drift = added / max(1, fitted_on)
    return {"generation": g.number, "base_documents": g.base_documents, "delta_segments": len(g.segments),
            "delta_documents": g.total - g.base_documents, "deleted_or_replaced": g.deleted_count,
            "tombstone_files": len(g.tombstones), "live_documents": g.live_documents,
            "fitted_on_documents": fitted_on, "added_since_fit": added, "drift": round(drift, 4),
            "rebuild_recommended": drift > DRIFT_REBUILD}
