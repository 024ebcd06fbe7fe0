"""A live index: a base segment plus delta segments, published as numbered generations.

Layout (the base is today's index directory; `live/` appears with the first write):

    INDEX/manifest.json, ann.faiss, embeddings.bin, ...   the base of generation 0
    INDEX/live/CURRENT                  name of the published generation file (atomic rename)
    INDEX/live/gen-000007.json          the generation record (below)
    INDEX/live/seg-000005/              a delta: ann.faiss, records.npy, ids*.npy, docs.*, metadata/
    INDEX/live/tomb-000007.npy          doc numbers deleted or replaced (sorted int64)
    INDEX/live/base-000006/             a rewritten base (a complete index directory)

Doc numbers are global across a generation: the base holds 0..N0-1, each delta the
range after the one before. Deltas append their records to the base's embeddings.bin
(block-aligned, past the published end), so one reader serves every segment; published
bytes never change and published files are never rewritten. Each delta's IVF holds global
ids under the base's trained quantizer, and at open the lists of all segments are
stacked (`faiss.HStackInvertedLists`) into one searchable IVF without copying the base's
memory-mapped lists.

Deletions are tombstones: each generation that deletes or replaces documents writes one
small file of their doc numbers, and the generation names every tombstone file in force
(the writer merges small ones, so their number stays small). A reader builds the live
mask from them. A merge of deltas keeps every doc number (a deleted document stays as a
hole: no vector in the IVF, no id), so tombstones never need rewriting until the base is.

The generation record is self-describing: the base with every file of it (bytes and
sha256, as in its manifest) and the published length of its embeddings.bin, every
segment with its files and the byte ranges of embeddings.bin its records lie in (each
with its sha256), every tombstone file, and `side`: per-generation side indexes (a
full-text index) with their files. `Generation.needed_files()` lists it all, so a copy
of an index is the files a generation names, then the record itself.

A reader holds a shared `flock` on the generation file it opened; the writer removes a
generation's files only once it can take that lock exclusively. Generations of one
process share what does not change between them (`open_view(previous=...)`): the base's
maps and IVF, the segments, the embedding reader. Nothing here keeps a file descriptor
per generation besides that lock (`espn.mapped`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import faiss
import numpy as np

from .ann import load_ivf
from .errors import DocumentNotFoundError, IndexCorruptError
from .index import DocStore, IdMap, IndexDirectory, sha256_file
from .lease import Shared
from .metadata import MetadataColumns, SegmentedColumns, schema_of
from .results import Document

__all__ = [
    "LIVE_DIR",
    "CURRENT",
    "GENERATION_FORMAT",
    "SEGMENT_FILES",
    "ByteRange",
    "SegmentInfo",
    "TombstoneFile",
    "Generation",
    "held_generation",
    "NeededFile",
    "LiveView",
    "OpenBase",
    "RecordTable",
    "SegmentedIdMap",
    "SegmentedDocStore",
    "read_current",
    "read_generation",
    "open_view",
    "empty_ivf",
    "stack_ivf",
    "read_tombstones",
    "current_token",
    "generation_schema",
]

LIVE_DIR = "live"
CURRENT = "CURRENT"
#: Version of the generation record; 1 was the per-generation deletion bitmap.
GENERATION_FORMAT = 2
#: Files of a delta segment (its records live in the base's embeddings.bin).
SEGMENT_FILES = ("ann.faiss", "records.npy", "ids.npy", "ids_sorted.npy", "docs.jsonl", "docs_offsets.npy")


@dataclasses.dataclass(frozen=True)
class ByteRange:
    """Bytes [start, stop) of the base's embeddings.bin, with their sha256."""

    start: int
    stop: int
    sha256: str

    def to_json(self) -> list[Any]:
        return [self.start, self.stop, self.sha256]

    @classmethod
    def from_json(cls, obj: Sequence[Any]) -> "ByteRange":
        return cls(int(obj[0]), int(obj[1]), str(obj[2]))


@dataclasses.dataclass(frozen=True)
class SegmentInfo:
    """A delta segment: doc numbers first .. first+documents-1; its records lie in `records`,
    byte ranges of the base's embeddings.bin (one for a delta a write made, several for a merge)."""

    name: str
    first: int
    documents: int
    files: dict[str, dict[str, Any]]
    records: tuple[ByteRange, ...]
    #: The segment's `metadata` section (its columns under seg-N/metadata/), None: no metadata.
    metadata: dict[str, Any] | None = None

    @property
    def stop(self) -> int:
        return self.first + self.documents

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "first": self.first, "documents": self.documents, "files": self.files,
                "records": [r.to_json() for r in self.records], "metadata": self.metadata}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "SegmentInfo":
        return cls(obj["name"], int(obj["first"]), int(obj["documents"]), obj["files"],
                   tuple(ByteRange.from_json(r) for r in obj["records"]), obj.get("metadata"))

    def columns(self, directory: Path) -> MetadataColumns:
        return MetadataColumns.open(directory, {"counts": {"documents": self.documents}, "metadata": self.metadata})


@dataclasses.dataclass(frozen=True)
class TombstoneFile:
    """live/<file>: `count` doc numbers (sorted int64 .npy) deleted or replaced."""

    file: str
    count: int
    bytes: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "TombstoneFile":
        return cls(obj["file"], int(obj["count"]), int(obj["bytes"]), obj["sha256"])


@dataclasses.dataclass(frozen=True)
class NeededFile:
    """One file a generation needs (path relative to the index), or a byte range of it."""

    path: str
    bytes: int
    sha256: str | None  # None: not checksummed (the base's manifest.json, which lists the others)
    range: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Generation:
    """One published state of the index. base: "." (the index root) or "live/base-NNNNNN".

    base_files: every file of the base, {name: {"bytes", "sha256"}} as its manifest lists
    them (embeddings.bin with the bytes the build wrote; what deltas appended is in their
    `records` ranges). side: per-generation side indexes, {name: {"files": {path: {...}}, ...}}
    with paths relative to live/.
    """

    number: int
    base: str
    base_documents: int
    embeddings_bytes: int  # published length of the base's embeddings.bin
    segments: tuple[SegmentInfo, ...] = ()
    tombstones: tuple[TombstoneFile, ...] = ()
    created: str = ""
    base_files: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    side: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        """Doc numbers in use (live, deleted and replaced)."""
        return self.base_documents + sum(s.documents for s in self.segments)

    @property
    def deleted_count(self) -> int:
        """Doc numbers deleted or replaced (tombstone files never overlap)."""
        return sum(t.count for t in self.tombstones)

    @property
    def live_documents(self) -> int:
        return self.total - self.deleted_count

    @property
    def file_name(self) -> str:
        return f"gen-{self.number:06d}.json"

    def to_json(self) -> dict[str, Any]:
        return {"format": GENERATION_FORMAT, "generation": self.number, "created": self.created,
                "base": {"path": self.base, "documents": self.base_documents,
                         "embeddings_bytes": self.embeddings_bytes, "files": self.base_files},
                "segments": [s.to_json() for s in self.segments],
                "tombstones": [t.to_json() for t in self.tombstones], "side": self.side}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Generation":
        if obj.get("format") != GENERATION_FORMAT:
            raise ValueError(f"generation format {obj.get('format', 1)!r}; this espn reads format "
                             f"{GENERATION_FORMAT} (written by an older espn: compact the index with that version, "
                             f"or rebuild it)")
        base = obj["base"]
        return cls(int(obj["generation"]), base["path"], int(base["documents"]), int(base["embeddings_bytes"]),
                   tuple(SegmentInfo.from_json(s) for s in obj["segments"]),
                   tuple(TombstoneFile.from_json(t) for t in obj["tombstones"]), obj.get("created", ""),
                   dict(base.get("files") or {}), dict(obj.get("side") or {}))

    def referenced(self) -> set[str]:
        """Paths (relative to the index) this generation needs besides the root's files."""
        names = {self.base} | {f"{LIVE_DIR}/{s.name}" for s in self.segments}
        names |= {f"{LIVE_DIR}/{t.file}" for t in self.tombstones}
        for side in self.side.values():
            names |= {f"{LIVE_DIR}/{path.split('/')[0]}" for path in side.get("files", {})}
        return names

    def needed_files(self) -> list[NeededFile]:
        """Every file and appended byte range this generation needs, with bytes and sha256:
        what a copy (a replica, a snapshot) must hold before the generation record itself."""
        base = "" if self.base == "." else f"{self.base}/"
        out = [NeededFile(f"{base}manifest.json", -1, None)]
        out += [NeededFile(f"{base}{name}", int(f["bytes"]), f["sha256"]) for name, f in sorted(self.base_files.items())]
        ranges = {(r.start, r.stop, r.sha256) for s in self.segments for r in s.records}
        out += [NeededFile(f"{base}embeddings.bin", stop - start, sha, (start, stop)) for start, stop, sha in sorted(ranges)]
        for s in self.segments:
            out += [NeededFile(f"{LIVE_DIR}/{s.name}/{name}", int(f["bytes"]), f["sha256"])
                    for name, f in sorted(s.files.items())]
        out += [NeededFile(f"{LIVE_DIR}/{t.file}", t.bytes, t.sha256) for t in self.tombstones]
        for side in self.side.values():
            out += [NeededFile(f"{LIVE_DIR}/{path}", int(f["bytes"]), f["sha256"])
                    for path, f in sorted(side.get("files", {}).items())]
        return out


def _generation_zero(root: Path) -> Generation:
    from .index import read_manifest

    manifest = read_manifest(root)
    files = manifest["files"]
    return Generation(0, ".", int(manifest["counts"]["documents"]), int(files["embeddings.bin"]["bytes"]),
                      base_files=dict(files))


def current_token(root: Path) -> tuple[int, int]:
    """(inode, mtime) of live/CURRENT, (0, 0) without one: changes with every publish (a rename)."""
    try:
        st = os.stat(Path(root) / LIVE_DIR / CURRENT)
    except FileNotFoundError:
        return (0, 0)
    return (st.st_ino, st.st_mtime_ns)


def read_current(root: Path | str) -> Generation:
    """The published generation (generation 0 when the index was never written to)."""
    root = Path(root)
    current = root / LIVE_DIR / CURRENT
    if not current.is_file():
        return _generation_zero(root)
    name = current.read_text().strip()
    return read_generation(root / LIVE_DIR / name)


def read_generation(path: Path) -> Generation:
    """A generation record; IndexCorruptError naming the file when it cannot be read."""
    try:
        return Generation.from_json(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise IndexCorruptError(f"{path}: missing (live/CURRENT names it)") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise IndexCorruptError(f"{path}: unreadable generation file ({exc})") from None


def _hold(root: Path) -> tuple[Generation, int]:
    """The current generation and an fd holding a shared lock on it (the writer's GC waits for it)."""
    for _ in range(100):
        generation = read_current(root)
        lock_path = root / ("manifest.json" if generation.number == 0 else f"{LIVE_DIR}/{generation.file_name}")
        try:
            fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # collected between reading CURRENT and opening it: read CURRENT again
        fcntl.flock(fd, fcntl.LOCK_SH)
        # The collector unlinks a generation under its exclusive lock; ours may have come after.
        still_there = (root / LIVE_DIR / generation.file_name).exists() if generation.number else \
            (root / "ann.faiss").exists() and read_current(root).number == 0
        if still_there:
            return generation, fd
        os.close(fd)
    raise IndexCorruptError(f"{root}: the current generation kept disappearing while it was being opened")


@contextlib.contextmanager
def held_generation(root: Path | str) -> Iterator[Generation]:
    """The current generation, held for the block: the writer's garbage collector keeps every
    file it needs (what a copy of it, such as a snapshot, reads meanwhile)."""
    generation, fd = _hold(Path(root))
    try:
        yield generation
    finally:
        os.close(fd)


def read_tombstones(root: Path, generation: Generation, verify: bool = False) -> np.ndarray:
    """[deleted_count] int64, sorted: the doc numbers a generation holds deleted or replaced."""
    parts = []
    for t in generation.tombstones:
        path = Path(root) / LIVE_DIR / t.file
        if verify and sha256_file(path) != t.sha256:
            raise IndexCorruptError(f"{path}: checksum mismatch (corrupted)")
        try:
            numbers = np.load(path, allow_pickle=False)  # read whole: small, and no descriptor kept
        except (OSError, ValueError) as exc:
            raise IndexCorruptError(f"{path}: unreadable tombstones ({exc})") from None
        if numbers.dtype != np.int64 or numbers.ndim != 1 or len(numbers) != t.count:
            raise IndexCorruptError(f"{path}: {numbers.shape} {numbers.dtype}, the generation says {t.count} int64")
        parts.append(numbers)
    if not parts:
        return np.zeros(0, dtype=np.int64)
    out = np.sort(np.concatenate(parts)) if len(parts) > 1 else parts[0]
    if len(out) and (out[0] < 0 or out[-1] >= generation.total):
        raise IndexCorruptError(f"{root}: generation {generation.number} holds tombstones outside its "
                                f"{generation.total} doc numbers")
    return out


def empty_ivf(ivf: faiss.IndexIVF) -> faiss.IndexIVF:
    """A trained IVF like `ivf` (same quantizer, codec and nlist) with empty lists.

    Built by lending `ivf` empty lists while it is serialized, so the base's (possibly
    memory-mapped, multi-GB) lists are never copied.
    """
    original, ntotal = ivf.invlists, ivf.ntotal
    assert original is not None, "an IVF index always has inverted lists"
    own = ivf.own_invlists
    ivf.own_invlists = False
    empty = faiss.ArrayInvertedLists(ivf.nlist, ivf.code_size)
    try:
        ivf.replace_invlists(empty, False)
        ivf.ntotal = 0
        blob = faiss.serialize_index(ivf)
    finally:
        ivf.replace_invlists(original, own)
        ivf.ntotal = ntotal
    index = faiss.deserialize_index(blob)
    out = faiss.extract_index_ivf(index)
    out.referenced_objects = [index]  # type: ignore[attr-defined]
    return out


def stack_ivf(parts: Sequence[faiss.IndexIVF]) -> faiss.IndexIVF:
    """One searchable IVF over segments that share a quantizer: list i is the concatenation of
    every segment's list i (`HStackInvertedLists`, read-only, no copy). Ids are the segments' own
    (global doc numbers)."""
    if len(parts) == 1:
        return parts[0]
    wrapper = empty_ivf(parts[0])
    lists = faiss.InvertedListsPtrVector()  # type: ignore[attr-defined]
    for part in parts:
        lists.push_back(part.invlists)
    stacked = faiss.HStackInvertedLists(lists.size(), lists.data())
    stacked.this.disown()  # type: ignore[attr-defined]  # the wrapper owns it from here
    wrapper.replace_invlists(stacked, True)
    wrapper.ntotal = sum(int(p.ntotal) for p in parts)
    wrapper.referenced_objects = [*wrapper.referenced_objects, *parts]  # type: ignore[attr-defined]
    wrapper.parallel_mode = 3  # as load_ivf: split a batch's queries over the threads
    return wrapper


class SegmentedIdMap:
    """External id <-> global doc number over the segments of one generation.

    Only the newest version of an id can be live, so `internal` looks in the newest segment
    holding the id and answers not-found when that version is deleted.
    """

    def __init__(self, maps: Sequence[IdMap], firsts: Sequence[int], deleted: np.ndarray | None) -> None:
        self.maps, self.firsts = list(maps), np.asarray(firsts, dtype=np.int64)
        self.deleted = deleted

    def external(self, doc_numbers: Iterable[int]) -> list[str]:
        numbers = np.asarray(list(doc_numbers) if not isinstance(doc_numbers, np.ndarray) else doc_numbers,
                             dtype=np.int64)
        seg = np.searchsorted(self.firsts, numbers, side="right") - 1
        out = [""] * len(numbers)
        for s in np.unique(seg):
            where = np.flatnonzero(seg == s)
            for i, name in zip(where, self.maps[s].external(numbers[where] - self.firsts[s])):
                out[i] = name
        return out

    def lookup(self, doc_id: str) -> int | None:
        """The doc number of the newest version of `doc_id` (live or not), None if never stored."""
        for s in range(len(self.maps) - 1, -1, -1):
            try:
                return int(self.firsts[s]) + self.maps[s].internal(doc_id)
            except DocumentNotFoundError:
                continue
        return None

    def internal(self, doc_id: str) -> int:
        number = self.lookup(doc_id)
        if number is None or (self.deleted is not None and self.deleted[number]):
            raise DocumentNotFoundError(f"no document with id {doc_id!r}")
        return number


class SegmentedDocStore:
    """Passages by global doc number, each read from its segment's docs.jsonl."""

    def __init__(self, stores: Sequence[DocStore], firsts: Sequence[int]) -> None:
        self.stores, self.firsts = list(stores), np.asarray(firsts, dtype=np.int64)

    def _route(self, doc_number: int) -> tuple[DocStore, int]:
        s = int(np.searchsorted(self.firsts, doc_number, side="right")) - 1
        return self.stores[s], doc_number - int(self.firsts[s])

    def get(self, doc_number: int) -> tuple[str, str]:
        store, local = self._route(doc_number)
        return store.get(local)

    def metadata(self, doc_number: int) -> dict[str, Any]:
        """The `metadata` object stored with a passage ({} when none)."""
        store, local = self._route(doc_number)
        start, end = int(store.offsets[local]), int(store.offsets[local + 1])
        with open(store.path, "rb") as f:
            f.seek(start)
            return dict(json.loads(f.read(end - start)).get("metadata") or {})

    def document(self, doc_id: str, doc_number: int) -> Document:
        store, local = self._route(doc_number)
        return store.document(doc_id, local)


class RecordTable:
    """records.npy rows by global doc number: the base's (memory-mapped) table, then the
    deltas' rows, without copying the base's table for every generation.

    What a Reader needs of its `records`: `len`, `dtype`, `ndim`, and indexing by one
    number or an int64 array (structured RECORD_DTYPE rows back).
    """

    ndim = 1

    def __init__(self, base: np.ndarray, tail: np.ndarray) -> None:
        self.base, self.tail = base, tail
        self.dtype = base.dtype
        self._n0 = len(base)

    def __len__(self) -> int:
        return self._n0 + len(self.tail)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, (int, np.integer)):
            i = int(index) + (len(self) if index < 0 else 0)
            return self.base[i] if i < self._n0 else self.tail[i - self._n0]
        numbers = np.asarray(index)
        if numbers.dtype == np.bool_:
            numbers = np.flatnonzero(numbers)
        numbers = numbers.astype(np.int64, copy=False)
        out = np.empty(numbers.shape, dtype=self.dtype)
        low = numbers < self._n0
        out[low] = self.base[numbers[low]]
        out[~low] = self.tail[numbers[~low] - self._n0]
        return out


class OpenBase:
    """The opened base of a live index, shared by every generation over it in one process.

    Its maps hold no descriptor; what a Searcher attaches (its reader, its prefetch pool)
    is closed with the base, when the last generation holding it closes.
    """

    def __init__(self, directory: IndexDirectory) -> None:
        self.directory = directory
        self.ann = load_ivf(directory.file("ann.faiss"))
        self.records = directory.load_array("records.npy")
        self.ids = IdMap(directory.load_array("ids.npy"), directory.load_array("ids_sorted.npy"))
        self.docs = DocStore(directory.file("docs.jsonl"), directory.load_array("docs_offsets.npy"))
        self.columns = MetadataColumns.open(directory.path, directory.manifest)
        self._attached: dict[str, tuple[Any, Callable[[], None]]] = {}
        self._attach_lock = threading.Lock()
        self.hold = Shared(self._close)

    def attached(self, key: str, make: Callable[[], Any], close: Callable[[Any], None]) -> Any:
        """The object attached under `key`, made (and closed with this base) on first use."""
        with self._attach_lock:
            if key not in self._attached:
                value = make()
                self._attached[key] = (value, lambda: close(value))
            return self._attached[key][0]

    def _close(self) -> None:
        with self._attach_lock:
            attached, self._attached = list(self._attached.values()), {}
        for _, close in reversed(attached):
            close()


@dataclasses.dataclass
class _OpenSegment:
    info: SegmentInfo
    ann: faiss.IndexIVF
    records: np.ndarray
    ids: IdMap
    docs: DocStore
    columns: MetadataColumns


@dataclasses.dataclass
class LiveView:
    """What a Searcher needs of one generation: every array global over its segments.

    records [total] RECORD_DTYPE (a RecordTable when there are deltas), ann over every
    segment, live [total] bool (None: all live). `shared`: the opened base, held by this
    view. `close()` releases the generation (the writer may then remove its files).
    """

    root: Path
    generation: Generation
    base: IndexDirectory
    ann: faiss.IndexIVF
    records: np.ndarray | RecordTable
    ids: SegmentedIdMap
    docs: SegmentedDocStore
    live: np.ndarray | None
    #: The metadata columns of every segment (filters compile over them).
    metadata: MetadataColumns | SegmentedColumns
    shared: OpenBase
    segments: dict[str, _OpenSegment]
    _lock_fd: int | None = None

    @property
    def embeddings(self) -> Path:
        return self.base.file("embeddings.bin")

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
            self.shared.hold.release()


def _check_segment(directory: Path, info: SegmentInfo, embeddings: Path, verify: str) -> None:
    for name, expected in info.files.items():
        file = directory / name
        if not file.is_file():
            raise IndexCorruptError(f"{file}: missing")
        if file.stat().st_size != expected["bytes"]:
            raise IndexCorruptError(f"{file}: {file.stat().st_size} bytes, the generation says {expected['bytes']}")
        if verify == "full" and sha256_file(file) != expected["sha256"]:
            raise IndexCorruptError(f"{file}: checksum mismatch (corrupted)")
    size = embeddings.stat().st_size
    for r in info.records:
        if size < r.stop:
            raise IndexCorruptError(f"{embeddings}: shorter than segment {info.name}'s records (end at {r.stop})")
        if verify == "full" and sha256_file(embeddings, r.start, r.stop) != r.sha256:
            raise IndexCorruptError(f"{embeddings}: segment {info.name}'s records fail their checksum")


def _check_tombstones(root: Path, generation: Generation) -> None:
    for t in generation.tombstones:
        path = root / LIVE_DIR / t.file
        if not path.is_file():
            raise IndexCorruptError(f"{path}: missing")
        if path.stat().st_size != t.bytes:
            raise IndexCorruptError(f"{path}: {path.stat().st_size} bytes, the generation says {t.bytes}")


def generation_schema(base: IndexDirectory, generation: Generation) -> dict[str, str]:
    """Metadata field -> type over the base and every delta of a generation (from the manifests only)."""
    try:
        return schema_of([base.manifest.get("metadata")] + [info.metadata for info in generation.segments])
    except ValueError as exc:
        raise IndexCorruptError(f"{base.path}: {exc}") from None


def _open_segment(root: Path, info: SegmentInfo) -> _OpenSegment:
    directory = root / LIVE_DIR / info.name
    seg = IndexDirectory(directory, {})
    return _OpenSegment(info, load_ivf(directory / "ann.faiss"), seg.load_array("records.npy"),
                        IdMap(seg.load_array("ids.npy"), seg.load_array("ids_sorted.npy")),
                        DocStore(directory / "docs.jsonl", seg.load_array("docs_offsets.npy")),
                        info.columns(directory))


def open_view(root: Path | str, verify: str = "auto", previous: LiveView | None = None) -> LiveView:
    """Open the current generation of the index at `root` and hold it until `close()`.

    verify as `IndexDirectory.open` for the base; delta segments (small) are checked in
    full under "full"/"auto", by size under "fast", not at all under "none".
    previous: an open view of an older generation of the same index (kept open by the
    caller until this call returns); what the two have in common (the base, segments) is
    shared instead of opened again.
    """
    root = Path(root)
    if not root.is_dir():
        raise IndexCorruptError(f"{root}: no such index directory")
    generation, fd = _hold(root)
    shared: OpenBase | None = None
    try:
        if previous is not None and previous.generation.base == generation.base and previous.shared.hold.acquire():
            shared = previous.shared
        else:
            shared = OpenBase(IndexDirectory.open(root / generation.base, verify=verify,
                                                  appended=frozenset({"embeddings.bin"})))
        base = shared.directory
        if base.file("embeddings.bin").stat().st_size < generation.embeddings_bytes:
            raise IndexCorruptError(f"{base.file('embeddings.bin')}: shorter than the {generation.embeddings_bytes} "
                                    f"bytes generation {generation.number} published (truncated?)")
        seg_verify = {"auto": "full", "full": "full", "fast": "fast", "none": "none"}.get(verify, verify)
        known = previous.segments if previous is not None and previous.shared is shared else {}
        segments: dict[str, _OpenSegment] = {}
        for info in generation.segments:
            reuse = known.get(info.name)
            if reuse is not None and reuse.info == info:
                segments[info.name] = reuse
                continue
            if seg_verify != "none":
                _check_segment(root / LIVE_DIR / info.name, info, base.file("embeddings.bin"), seg_verify)
            segments[info.name] = _open_segment(root, info)
        if seg_verify != "none":
            _check_tombstones(root, generation)
        opened = [segments[info.name] for info in generation.segments]
        firsts = [0] + [info.first for info in generation.segments]
        tail = np.concatenate([s.records for s in opened]) if opened else None
        records: np.ndarray | RecordTable = shared.records if tail is None else RecordTable(shared.records, tail)
        ann = stack_ivf([shared.ann] + [s.ann for s in opened])
        if ann.ntotal > generation.total or len(records) != generation.total:
            raise IndexCorruptError(f"{root}: generation {generation.number} counts {generation.total} documents, "
                                    f"its files {ann.ntotal} vectors and {len(records)} records")
        tombstones = read_tombstones(root, generation, verify=seg_verify == "full")
        live = None
        if len(tombstones):
            live = np.ones(generation.total, dtype=bool)
            live[tombstones] = False
        columns = [shared.columns] + [s.columns for s in opened]
        return LiveView(root, generation, base, ann, records,
                        SegmentedIdMap([shared.ids] + [s.ids for s in opened], firsts, None if live is None else ~live),
                        SegmentedDocStore([shared.docs] + [s.docs for s in opened], firsts), live,
                        columns[0] if len(columns) == 1 else SegmentedColumns(columns, generation_schema(base, generation)),
                        shared, segments, fd)
    except BaseException:
        os.close(fd)
        if shared is not None:
            shared.hold.release()
        raise
