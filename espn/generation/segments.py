"""A live index opened for search: a base segment plus delta segments, one generation of them.

Doc numbers are global across a generation: the base holds 0..N0-1, each delta the
range after the one before. Deltas append their records to the base's embeddings.bin
(block-aligned, past the published end), so one reader serves every segment. Each delta's
IVF holds global ids under the base's trained quantizer, and at open the lists of all
segments are stacked (`faiss.HStackInvertedLists`) into one searchable IVF without copying
the base's memory-mapped lists. The layout and the generation record are espn.generation.format.

A reader holds a shared `flock` on the generation file it opened; the writer removes a
generation's files only once it can take that lock exclusively. Generations of one
process share what does not change between them (`open_view(previous=...)`): the base's
maps and IVF, the segments, the embedding reader. Nothing here keeps a file descriptor
per generation besides that lock (`espn.mapped`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import faiss
import numpy as np

from ..ann import load_ivf
from ..errors import DocumentNotFoundError, IndexCorruptError
from ..files.checksums import sha256_file
from .format import LIVE_DIR, Generation, SegmentInfo, generation_schema, hold_current, read_tombstones
from ..index import DocStore, IdMap, IndexDirectory
from ..refcount import Shared
from ..metadata import MetadataColumns, SegmentedColumns
from ..results import Document

__all__ = [
    "LiveView",
    "OpenBase",
    "RecordTable",
    "SegmentedIdMap",
    "SegmentedDocStore",
    "open_view",
    "empty_ivf",
    "stack_ivf",
]

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
        if len(self.maps) == 1:  # an index without deltas: its base's ids, no grouping by segment
            return self.maps[0].external(numbers)
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
    generation, fd = hold_current(root)
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
