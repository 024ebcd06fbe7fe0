"""A live index: a base segment plus delta segments, published as numbered generations.

Layout (the base is today's index directory; `live/` appears with the first write):

    INDEX/manifest.json, ann.faiss, embeddings.bin, ...   the base of generation 0
    INDEX/live/CURRENT                  name of the published generation file (atomic rename)
    INDEX/live/gen-000007.json          base, segments, deletion bitmap, checksums
    INDEX/live/seg-000005/              a delta: ann.faiss, records.npy, ids*.npy, docs.*
    INDEX/live/deleted-000007.npy       packed bits over every doc number: deleted or replaced
    INDEX/live/base-000006/             a compacted base (a complete index directory)

Doc numbers are global across a generation: the base holds 0..N0-1, each delta the
range after the one before. Deltas append their records to the base's embeddings.bin
(block-aligned, past the published end), so one reader serves every segment; published
bytes never change. Each delta's IVF holds global ids under the base's trained
quantizer, and at open the lists of all segments are stacked (`faiss.HStackInvertedLists`)
into one searchable IVF without copying the base's memory-mapped lists. A reader holds a
shared `flock` on the generation file it opened; the writer removes a generation's files
only once it can take that lock exclusively.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import faiss
import numpy as np

from .ann import load_ivf
from .errors import DocumentNotFoundError, IndexCorruptError
from .index import DocStore, IdMap, IndexDirectory, fsync_path, sha256_file
from .metadata import MetadataColumns, SegmentedColumns, schema_of
from .results import Document

__all__ = [
    "LIVE_DIR",
    "SEGMENT_FILES",
    "SegmentInfo",
    "Generation",
    "LiveView",
    "SegmentedIdMap",
    "SegmentedDocStore",
    "read_current",
    "open_view",
    "empty_ivf",
    "stack_ivf",
    "read_deleted",
    "current_token",
]

LIVE_DIR = "live"
CURRENT = "CURRENT"
#: Files of a delta segment (its records live in the base's embeddings.bin).
SEGMENT_FILES = ("ann.faiss", "records.npy", "ids.npy", "ids_sorted.npy", "docs.jsonl", "docs_offsets.npy")


@dataclasses.dataclass(frozen=True)
class SegmentInfo:
    """A delta segment: doc numbers first .. first+documents-1, records in embeddings bytes [start, stop)."""

    name: str
    first: int
    documents: int
    embeddings: tuple[int, int]
    embeddings_sha256: str
    files: dict[str, dict[str, Any]]
    #: The segment's `metadata` section (its columns under seg-N/metadata/), None: no metadata.
    metadata: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "first": self.first, "documents": self.documents,
                "embeddings": list(self.embeddings), "embeddings_sha256": self.embeddings_sha256, "files": self.files,
                "metadata": self.metadata}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "SegmentInfo":
        start, stop = obj["embeddings"]
        return cls(obj["name"], int(obj["first"]), int(obj["documents"]), (int(start), int(stop)),
                   obj["embeddings_sha256"], obj["files"], obj.get("metadata"))

    def columns(self, directory: Path) -> MetadataColumns:
        return MetadataColumns.open(directory, {"counts": {"documents": self.documents}, "metadata": self.metadata})


@dataclasses.dataclass(frozen=True)
class Generation:
    """One published state of the index. base: "." (the index root) or "live/base-NNNNNN"."""

    number: int
    base: str
    base_documents: int
    embeddings_bytes: int  # published length of the base's embeddings.bin
    segments: tuple[SegmentInfo, ...] = ()
    deleted: dict[str, Any] | None = None  # {"file", "count", "sha256"}
    created: str = ""

    @property
    def total(self) -> int:
        """Doc numbers in use (live, deleted and replaced)."""
        return self.base_documents + sum(s.documents for s in self.segments)

    @property
    def deleted_count(self) -> int:
        return int(self.deleted["count"]) if self.deleted else 0

    @property
    def live_documents(self) -> int:
        return self.total - self.deleted_count

    @property
    def file_name(self) -> str:
        return f"gen-{self.number:06d}.json"

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.number, "base": self.base, "base_documents": self.base_documents,
                "embeddings_bytes": self.embeddings_bytes, "segments": [s.to_json() for s in self.segments],
                "deleted": self.deleted, "created": self.created}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Generation":
        return cls(int(obj["generation"]), obj["base"], int(obj["base_documents"]), int(obj["embeddings_bytes"]),
                   tuple(SegmentInfo.from_json(s) for s in obj["segments"]), obj.get("deleted"),
                   obj.get("created", ""))

    def referenced(self) -> set[str]:
        """Paths (relative to the index) this generation needs besides the root's files."""
        names = {self.base} | {f"{LIVE_DIR}/{s.name}" for s in self.segments}
        if self.deleted:
            names.add(f"{LIVE_DIR}/{self.deleted['file']}")
        return names


def _generation_zero(root: Path) -> Generation:
    from .index import read_manifest

    manifest = read_manifest(root)
    return Generation(0, ".", int(manifest["counts"]["documents"]), int(manifest["files"]["embeddings.bin"]["bytes"]))


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
    return _read_generation(root / LIVE_DIR / name)


def _read_generation(path: Path) -> Generation:
    try:
        return Generation.from_json(json.loads(path.read_text(encoding="utf-8")))
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


def read_deleted(root: Path, generation: Generation) -> np.ndarray | None:
    """[total] bool, True for deleted or replaced doc numbers; None when nothing is deleted."""
    if not generation.deleted:
        return None
    packed = np.load(root / LIVE_DIR / generation.deleted["file"], allow_pickle=False)
    return np.unpackbits(packed, count=generation.total, bitorder="little").astype(bool)


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
        title, text = self.get(doc_number)
        return Document(doc_id=doc_id, title=title, text=text)


@dataclasses.dataclass
class LiveView:
    """What a Searcher needs of one generation: every array global over its segments.

    records [total] RECORD_DTYPE, ann over every segment, live [total] bool (None: all live).
    `close()` releases the generation (the writer may then remove its files).
    """

    root: Path
    generation: Generation
    base: IndexDirectory
    ann: faiss.IndexIVF
    records: np.ndarray
    ids: SegmentedIdMap
    docs: SegmentedDocStore
    live: np.ndarray | None
    #: The metadata columns of every segment (filters compile over them).
    metadata: MetadataColumns | SegmentedColumns
    _lock_fd: int | None = None

    @property
    def embeddings(self) -> Path:
        return self.base.file("embeddings.bin")

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _check_segment(directory: Path, info: SegmentInfo, embeddings: Path, verify: str) -> None:
    for name, expected in info.files.items():
        file = directory / name
        if not file.is_file():
            raise IndexCorruptError(f"{file}: missing")
        if file.stat().st_size != expected["bytes"]:
            raise IndexCorruptError(f"{file}: {file.stat().st_size} bytes, the generation says {expected['bytes']}")
        if verify == "full" and sha256_file(file) != expected["sha256"]:
            raise IndexCorruptError(f"{file}: checksum mismatch (corrupted)")
    start, stop = info.embeddings
    if embeddings.stat().st_size < stop:
        raise IndexCorruptError(f"{embeddings}: shorter than segment {info.name}'s records (ends at {stop})")
    if verify == "full" and sha256_file(embeddings, start, stop) != info.embeddings_sha256:
        raise IndexCorruptError(f"{embeddings}: segment {info.name}'s records fail their checksum")


def generation_schema(base: IndexDirectory, generation: Generation) -> dict[str, str]:
    """Metadata field -> type over the base and every delta of a generation (from the manifests only)."""
    try:
        return schema_of([base.manifest.get("metadata")] + [info.metadata for info in generation.segments])
    except ValueError as exc:
        raise IndexCorruptError(f"{base.path}: {exc}") from None


def open_view(root: Path | str, verify: str = "auto") -> LiveView:
    """Open the current generation of the index at `root` and hold it until `close()`.

    verify as `IndexDirectory.open` for the base; delta segments (small) are checked in
    full under "full"/"auto", by size under "fast", not at all under "none".
    """
    root = Path(root)
    if not root.is_dir():
        raise IndexCorruptError(f"{root}: no such index directory")
    generation, fd = _hold(root)
    try:
        base = IndexDirectory.open(root / generation.base, verify=verify, appended=frozenset({"embeddings.bin"}))
        ann_parts = [load_ivf(base.file("ann.faiss"))]
        records = [base.load_array("records.npy")]
        maps = [IdMap(base.load_array("ids.npy"), base.load_array("ids_sorted.npy"))]
        stores = [DocStore(base.file("docs.jsonl"), base.load_array("docs_offsets.npy"))]
        firsts = [0]
        columns = [MetadataColumns.open(base.path, base.manifest)]
        seg_verify = {"auto": "full", "full": "full", "fast": "fast", "none": "none"}.get(verify, verify)
        for info in generation.segments:
            directory = root / LIVE_DIR / info.name
            if seg_verify != "none":
                _check_segment(directory, info, base.file("embeddings.bin"), seg_verify)
            seg = IndexDirectory(directory, {})
            ann_parts.append(load_ivf(directory / "ann.faiss"))
            records.append(seg.load_array("records.npy"))
            maps.append(IdMap(seg.load_array("ids.npy"), seg.load_array("ids_sorted.npy")))
            stores.append(DocStore(directory / "docs.jsonl", seg.load_array("docs_offsets.npy")))
            firsts.append(info.first)
            columns.append(info.columns(directory))
        deleted = read_deleted(root, generation)
        all_records = records[0] if len(records) == 1 else np.concatenate(records)
        ann = stack_ivf(ann_parts)
        if ann.ntotal != generation.total or len(all_records) != generation.total:
            raise IndexCorruptError(f"{root}: generation {generation.number} counts {generation.total} documents, "
                                    f"its files {ann.ntotal} vectors and {len(all_records)} records")
        return LiveView(root, generation, base, ann, all_records, SegmentedIdMap(maps, firsts, deleted),
                        SegmentedDocStore(stores, firsts), None if deleted is None else ~deleted,
                        columns[0] if len(columns) == 1 else SegmentedColumns(columns, generation_schema(base, generation)),
                        fd)
    except BaseException:
        os.close(fd)
        raise
