"""The on-disk format of a live index: its layout, the generation record, and reading which
generation is current (espn.generation.segments opens one for search; espn.live writes them).

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

A reader holds a shared `flock` on the generation file it opened (`held_generation`); the
writer removes a generation's files only once it can take that lock exclusively. Opening a
generation for search is espn.generation.segments.
"""


from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import re
import stat
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import IndexCorruptError
from ..files.checksums import sha256_file
from ..files.locks import lock_is_free
from ..index import IndexDirectory, read_manifest
from ..mapped import read_npy
from ..metadata import MetadataColumns, schema_of
from ..untrusted import load_json, read_bounded

__all__ = [
    "LIVE_DIR",
    "CURRENT",
    "GENERATION_FORMAT",
    "MAX_RECORD_BYTES",
    "MAX_CURRENT_BYTES",
    "RECORD_NAME",
    "SEGMENT_FILES",
    "ByteRange",
    "SegmentInfo",
    "TombstoneFile",
    "NeededFile",
    "Generation",
    "current_token",
    "read_current",
    "read_generation",
    "record_number",
    "check_recorded",
    "held_generation",
    "hold_current",
    "read_tombstones",
    "generation_schema",
]

LIVE_DIR = "live"
CURRENT = "CURRENT"
#: Version of the generation record; 1 was the per-generation deletion bitmap.
GENERATION_FORMAT = 2
#: Files of a delta segment (its records live in the base's embeddings.bin).
SEGMENT_FILES = ("ann.faiss", "records.npy", "ids.npy", "ids_sorted.npy", "docs.jsonl", "docs_offsets.npy")
#: The most bytes a generation record (live/gen-N.json, or one on object storage with its
#: pieces) may hold before it is parsed: a record lists files (about 150 bytes each), so this is
#: room for some 100,000 of them, and parsing it costs a bounded ~100 MB at worst.
MAX_RECORD_BYTES = 16 << 20
#: The most bytes live/CURRENT (and LATEST on object storage) may hold: one record name.
MAX_CURRENT_BYTES = 1024
#: What live/CURRENT and LATEST may name: a generation record, gen-NNNNNN.json.
RECORD_NAME = re.compile(r"gen-(\d{6})\.json\Z")
# What live/ holds that belongs to a generation (records, bases, segments, side indexes, tombstones).
_NUMBERED = re.compile(r"(?:gen|base|seg|text|tomb)-(\d{6})(?:\.json|\.npy)?\Z")



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
    """The published generation (generation 0 when the index was never written to).

    live/CURRENT is read as data from outside: a regular file of at most MAX_CURRENT_BYTES
    naming a record (`gen-NNNNNN.json`), never a path. Without it the index is generation 0
    only when that can be true: a `live/` holding a record past the first (`gen-000002.json`
    or later, which a writer commits only after CURRENT exists) means CURRENT was lost, and
    generation 0 would drop every write since the build: IndexCorruptError instead (the
    writer's crash recovery would otherwise remove those writes' files)."""
    root = Path(root)
    live = root / LIVE_DIR
    current = live / CURRENT
    try:
        raw = read_bounded(current, str(current), max_bytes=MAX_CURRENT_BYTES, error=IndexCorruptError)
    except IndexCorruptError:
        if os.path.lexists(current):
            raise
        later = [name for name in _numbered(live) if name.startswith("gen-") and int(name[4:10]) > 1]
        if later:
            raise IndexCorruptError(f"{current}: missing, but live/ holds {later[-1]} (written after a CURRENT "
                                    "existed): the generation recorded is lost, and generation 0 would drop every "
                                    "write since the build; restore the index from a snapshot or object storage")
        return _generation_zero(root)
    name = raw.decode("utf-8", "replace").strip()
    if not RECORD_NAME.match(name):
        raise IndexCorruptError(f"{current}: names {name[:80]!r}, not a generation record (gen-NNNNNN.json)")
    return read_generation(live / name)


def record_number(name: str) -> int | None:
    """N of a record name gen-NNNNNN.json, None for any other name."""
    match = RECORD_NAME.match(name)
    return int(match[1]) if match else None


def check_recorded(root: Path | str) -> Generation:
    """The current generation, checked to be the one the index records (what `espn verify`
    and a restore from a snapshot check, stricter than `read_current`): without live/CURRENT,
    live/ holds no generation record or generation file at all (not even the first write's,
    which only a crash between its record and CURRENT leaves, and the next writer removes);
    with it, no record newer than the one it names. IndexCorruptError in one line otherwise."""
    root = Path(root)
    live = root / LIVE_DIR
    if os.path.islink(live):
        raise IndexCorruptError(f"{live}: refused, a symbolic link (links are not followed)")
    generation = read_current(root)
    numbered = _numbered(live)
    newer = [name for name in numbered if name.startswith("gen-") and int(name[4:10]) > generation.number]
    if generation.number == 0 and numbered:
        problem = (f"{live / CURRENT}: missing, but live/ holds {numbered[-1]}: either the generation recorded is "
                   "lost (generation 0 would drop every write since the build) or a first write crashed before "
                   "it was published (the next writer removes it)")
    elif newer:
        problem = (f"{live / CURRENT}: names generation {generation.number}, but live/ holds {newer[-1]}, a newer "
                   "record: CURRENT was set back, or a write crashed before it was published (the next writer "
                   "removes it)")
    else:
        return generation
    if _writer_active(live):
        return generation  # a writer is publishing: its record comes before CURRENT moves
    raise IndexCorruptError(problem)


def _writer_active(live: Path) -> bool:
    """Whether a writer holds live/LOCK now (only a regular file is opened: a FIFO would hang)."""
    try:
        if not stat.S_ISREG(os.lstat(live / "LOCK").st_mode):
            return False
    except FileNotFoundError:
        return False
    return not lock_is_free(live / "LOCK")


def _numbered(live: Path) -> list[str]:
    """The names in live/ that belong to a generation, sorted by number ([] without live/)."""
    try:
        names = os.listdir(live)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [(int(match[1]), name) for name in names if (match := _NUMBERED.match(name))]
    return [name for _, name in sorted(found)]


def read_generation(path: Path) -> Generation:
    """A generation record; IndexCorruptError naming the file when it cannot be read. Read as
    data from outside: a regular file (no link, no FIFO) of at most MAX_RECORD_BYTES, nested at
    most MAX_JSON_DEPTH levels, whose number is the one its name says."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise IndexCorruptError(f"{path}: missing (live/CURRENT names it)")
    raw = read_bounded(path, str(path), max_bytes=MAX_RECORD_BYTES, error=IndexCorruptError)
    obj = load_json(raw, str(path), max_bytes=MAX_RECORD_BYTES, error=IndexCorruptError)
    try:
        generation = Generation.from_json(obj)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise IndexCorruptError(f"{path}: unreadable generation file ({type(exc).__name__}: {exc})") from None
    expected = record_number(path.name)
    if expected is not None and generation.number != expected:
        raise IndexCorruptError(f"{path}: records generation {generation.number}, not the {expected} its name says")
    return generation


def hold_current(root: Path) -> tuple[Generation, int]:
    """The current generation and an fd holding a shared lock on it (the writer's GC waits for it)."""
    for _ in range(100):
        generation = read_current(root)
        lock_path = root / ("manifest.json" if generation.number == 0 else f"{LIVE_DIR}/{generation.file_name}")
        try:
            # Not blocking: a FIFO swapped in after the record was read must not hang the open.
            fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
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
    generation, fd = hold_current(Path(root))
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
            numbers = read_npy(path)  # read whole: small, and no descriptor kept
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


def generation_schema(base: IndexDirectory, generation: Generation) -> dict[str, str]:
    """Metadata field -> type over the base and every delta of a generation (from the manifests only)."""
    try:
        return schema_of([base.manifest.get("metadata")] + [info.metadata for info in generation.segments])
    except ValueError as exc:
        raise IndexCorruptError(f"{base.path}: {exc}") from None
