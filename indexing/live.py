"""Writes to a live index: upsert, delete, compact; each publishes one generation.

`LiveIndex.open(INDEX)` takes the index's writer lock (`live/LOCK`, an exclusive
`flock`: a second writer is refused, or waits up to `wait_s`). New documents go through
the build's own encode stage (`encode_corpus` into chunk files) and the store's
`RecordWriter`, so a delta holds exactly what `espn index` would have written. Order of a
publish: records appended to the base's embeddings.bin past the published end and
fsynced, the segment directory written and renamed into place, the deletion bitmap,
the generation file, then `live/CURRENT` replaced by rename and the directory fsynced.
A `kill -9` anywhere before that rename leaves the previous generation current; the next
writer truncates the unpublished tail and removes the unpublished files (`_recover`).
See espn/segments.py for the layout and the reading side.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import faiss
import numpy as np

from espn.ann import load_ivf
from espn.encoders import Encoder, load_encoder
from espn.errors import ConflictError, CorpusError, DocumentNotFoundError, IndexLockedError, InvalidParameterError
from espn.index import FILES, IndexDirectory, fsync_path, read_manifest, sha256_file, write_json_atomic, write_manifest
from espn.segments import (
    LIVE_DIR,
    SEGMENT_FILES,
    Generation,
    LiveView,
    SegmentInfo,
    empty_ivf,
    open_view,
    read_current,
)
from espn.metadata import DIRECTORY as METADATA_DIR
from espn.metadata import MetadataWriter, add_from_passages, check_metadata, schema_of
from espn.store import open_reader
from espn.store.format import RECORD_DTYPE, RecordWriter, StoreLayout

from .assemble import default_search_params
from .chunks import finished_chunks, read_chunk
from .encode import encode_corpus
from .scan import scan_corpus

__all__ = ["LiveIndex", "NewDocument", "WriteResult", "IndexLockedError", "CompactionPolicy", "live_stats",
           "MAX_ID_BYTES", "MAX_TEXT_CHARS"]

log = logging.getLogger(__name__)

#: Longest external id (utf-8 bytes) and passage (characters) a write accepts.
MAX_ID_BYTES = 512
MAX_TEXT_CHARS = 100_000


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
class CompactionPolicy:
    """Compact once a generation has more than `max_segments` deltas or this deleted fraction."""

    max_segments: int = 8
    max_deleted_fraction: float = 0.2

    def due(self, generation: Generation) -> bool:
        if not generation.segments and not generation.deleted:
            return False
        return (len(generation.segments) > self.max_segments
                or generation.deleted_count > self.max_deleted_fraction * max(1, generation.total))


#: Test hook: called with a step name at each point a crash test kills the writer.
_checkpoint: Callable[[str], None] = lambda step: None


def _file_entries(directory: Path, names: Sequence[str]) -> dict[str, dict[str, Any]]:
    return {name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
            for name in names}


def _pack_ids(ids: Sequence[str] | np.ndarray) -> np.ndarray:
    return np.asarray(ids, dtype=bytes) if len(ids) else np.zeros(0, dtype="S1")


class LiveIndex:
    """The one writer of an index. Use as a context manager; every method publishes a generation."""

    def __init__(self, root: Path, lock_fd: int, encoder: Encoder | None = None) -> None:
        self.root = root
        self._lock_fd = lock_fd
        self._encoder = encoder
        self._recover()

    @classmethod
    def open(cls, root: Path | str, wait_s: float = 0.0, encoder: Encoder | None = None) -> "LiveIndex":
        """Take the writer lock (waiting up to `wait_s`); raises IndexLockedError when another holds it."""
        root = Path(root).absolute()
        read_manifest(root)  # a clear error for a path that is no index
        live = root / LIVE_DIR
        live.mkdir(exist_ok=True)
        fd = os.open(live / "LOCK", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise IndexLockedError(f"{root}: another writer holds {live / 'LOCK'}; one writer at a time") \
                        from None
                time.sleep(0.02)
        try:
            return cls(root, fd, encoder)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __enter__(self) -> "LiveIndex":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state -----------------------------------------------------------------------
    @property
    def live_dir(self) -> Path:
        return self.root / LIVE_DIR

    def current(self) -> Generation:
        return read_current(self.root)

    def _view(self) -> LiveView:
        return open_view(self.root, verify="none")

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

    def apply(self, upserts: Sequence[NewDocument] = (), deletes: Sequence[str] = ()) -> WriteResult:
        """Upserts and deletes as one generation: all visible at once, or (on any error) none."""
        _validate_documents(upserts)
        doc_ids = [d.doc_id for d in upserts]
        both = set(doc_ids) & set(deletes)
        if both:
            raise ConflictError(f"id {sorted(both)[0]!r} is both upserted and deleted in one batch")
        if len(set(deletes)) != len(deletes):
            raise ConflictError("delete lists an id twice")
        if not upserts and not deletes:
            raise InvalidParameterError("nothing to write: give documents to upsert or ids to delete")
        if deletes:  # unknown ids fail before anything is encoded or written
            view = self._view()
            try:
                for doc_id in deletes:
                    view.ids.internal(doc_id)
            finally:
                view.close()
        if not upserts:
            return self._publish(work=None, deletes=deletes)
        work = self.live_dir / "incoming"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            corpus = work / "corpus.jsonl"
            with open(corpus, "w", encoding="utf-8") as f:
                for d in upserts:
                    f.write(json.dumps({"_id": d.doc_id, "title": d.title, "text": d.text}, ensure_ascii=False) + "\n")
            metadata = [dict(d.metadata or {}) for d in upserts]
            return self._publish_corpus(corpus, work, deletes=deletes, metadata=metadata, loader_workers=0)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def add_corpus(self, corpus: Path, *, batch_size: int = 32, loader_workers: int = 1, progress: bool = False,
                   skip_bad: bool = False) -> WriteResult:
        """Upsert every document of a corpus file (BEIR jsonl or TSV) as one generation."""
        corpus = Path(corpus)
        if not corpus.is_file():
            raise CorpusError(f"{corpus}: no such file")
        if scan_corpus(corpus, skip_bad).documents == 0:  # ids unique, lines valid, before any encoding
            raise CorpusError(f"{corpus}: the corpus has no documents")
        work = self.live_dir / "incoming"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            return self._publish_corpus(corpus, work, deletes=(), batch_size=batch_size,
                                        loader_workers=loader_workers, progress=progress, skip_bad=skip_bad)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _publish_corpus(self, corpus: Path, work: Path, *, deletes: Sequence[str],
                        metadata: list[dict[str, Any]] | None = None, batch_size: int = 32, loader_workers: int = 1,
                        progress: bool = False, skip_bad: bool = False) -> WriteResult:
        encode_corpus(corpus, work, self.encoder(), batch_size=batch_size, loader_workers=loader_workers,
                      progress=progress, skip_bad=skip_bad)
        _checkpoint("encoded")
        return self._publish(work=work, deletes=deletes, metadata=metadata)

    def _publish(self, work: Path | None, deletes: Sequence[str],
                 metadata: list[dict[str, Any]] | None = None) -> WriteResult:
        current = self.current()
        view = self._view()
        try:
            deleted = np.zeros(current.total, dtype=bool) if view.live is None else ~view.live
            doomed = []
            for doc_id in deletes:
                doomed.append(view.ids.internal(doc_id))  # DocumentNotFoundError: nothing written yet
            number = current.number + 1
            segments = list(current.segments)
            created: list[str] = []
            replaced: list[str] = []
            if work is not None:
                info, new_ids = self._write_segment(work, current, number, metadata)
                segments.append(info)
                for doc_id in new_ids:
                    old = view.ids.lookup(doc_id)
                    if old is not None and not deleted[old]:
                        doomed.append(old)
                        replaced.append(doc_id)
                    else:
                        created.append(doc_id)
                deleted = np.concatenate([deleted, np.zeros(info.documents, dtype=bool)])
        finally:
            view.close()
        deleted[np.asarray(doomed, dtype=np.int64)] = True
        embeddings_bytes = segments[-1].embeddings[1] if len(segments) > len(current.segments) else \
            current.embeddings_bytes
        generation = Generation(number, current.base, current.base_documents, embeddings_bytes, tuple(segments),
                                self._write_deleted(deleted, number), _now())
        self._commit(generation)
        return WriteResult(number, created, replaced, list(deletes))

    def _write_segment(self, work: Path, current: Generation, number: int,
                       metadata: list[dict[str, Any]] | None) -> tuple[SegmentInfo, list[str]]:
        """Records appended to the base's embeddings.bin; the rest in live/seg-NNNNNN."""
        base = IndexDirectory(self.root / current.base, read_manifest(self.root / current.base))
        layout = StoreLayout.from_manifest(base.manifest["store"])  # pooling and storage type as the build's
        chunks = [read_chunk(work, c) for c in finished_chunks(work)]
        n = sum(len(c) for c in chunks)
        if n == 0:
            raise CorpusError("the documents to add are empty")
        name = f"seg-{number:06d}"
        staging = self.live_dir / f"{name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        first = current.total
        records = np.empty(n, dtype=RECORD_DTYPE)
        ids = np.concatenate([c.ids for c in chunks]) if chunks else np.zeros(0, "S1")
        cls = np.concatenate([c.cls for c in chunks]).astype(np.float32)
        lines = []
        for c in chunks:
            blob = c.docs_blob.tobytes()
            lines += [blob[c.docs_offsets[i] : c.docs_offsets[i + 1]] for i in range(len(c))]
        if metadata is not None:
            lines = [_with_metadata(line, meta) for line, meta in zip(lines, metadata)]
        columns = self._write_columns(staging, lines, base, current)
        start = current.embeddings_bytes
        # Truncates any unpublished tail first (a crashed writer's), then appends block-aligned.
        with RecordWriter(base.file("embeddings.bin"), layout, resume_at=start) as writer:
            at = 0
            for chunk in chunks:
                records[at : at + len(chunk)] = writer.append(chunk.cls, chunk.bow, chunk.counts)
                at += len(chunk)
            stop = writer.close()
        _checkpoint("appended")
        np.save(staging / "records.npy", records)
        np.save(staging / "ids.npy", ids)
        np.save(staging / "ids_sorted.npy", np.argsort(ids, kind="stable"))
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(line) for line in lines], out=offsets[1:])
        (staging / "docs.jsonl").write_bytes(b"".join(lines))
        np.save(staging / "docs_offsets.npy", offsets)
        ann = empty_ivf(load_ivf(base.file("ann.faiss")))
        ann.add_with_ids(cls, np.arange(first, first + n, dtype=np.int64))
        faiss.write_index(ann, str(staging / "ann.faiss"))
        for path in [*(staging / f for f in SEGMENT_FILES), *(staging / "metadata").glob("*.npy")]:
            fsync_path(path)
        if (staging / "metadata").is_dir():
            fsync_path(staging / "metadata")
        fsync_path(staging)
        final = self.live_dir / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        fsync_path(self.live_dir)
        _checkpoint("segment")
        column_files = sorted(str(p.relative_to(final)) for p in (final / "metadata").glob("*.npy"))
        info = SegmentInfo(name, first, n, (start, stop), sha256_file(base.file("embeddings.bin"), start, stop),
                           _file_entries(final, [*SEGMENT_FILES, *column_files]), columns)
        return info, [bytes(i).decode("utf-8") for i in ids]

    def _write_columns(self, staging: Path, lines: list[bytes], base: IndexDirectory,
                       current: Generation) -> dict[str, Any] | None:
        """The segment's metadata columns, from its passages; refused (before anything is
        appended) when a field's type conflicts with the one the index already holds."""
        writer = MetadataWriter(staging, len(lines))
        add_from_passages(writer, lines)
        section = writer.finish()
        try:
            schema_of([base.manifest.get("metadata"), *(info.metadata for info in current.segments), section])
        except ValueError as exc:
            raise ConflictError(str(exc)) from None
        return section

    def _write_deleted(self, deleted: np.ndarray, number: int) -> dict[str, Any] | None:
        count = int(deleted.sum())
        if count == 0:
            return None
        name = f"deleted-{number:06d}.npy"
        path = self.live_dir / name
        with open(path, "wb") as f:
            np.save(f, np.packbits(deleted, bitorder="little"))
            f.flush()
            os.fsync(f.fileno())
        _checkpoint("deleted")
        return {"file": name, "count": count, "sha256": sha256_file(path)}

    def _commit(self, generation: Generation) -> None:
        """Publish: the generation file, then CURRENT by rename; both fsynced, then the directory."""
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

    # -- compaction ------------------------------------------------------------------
    def compact(self) -> WriteResult:
        """Merge every segment into a new base without the deleted and replaced documents.

        The new base is a complete index directory (live/base-NNNNNN) written the way the build
        writes one: live documents in doc-number order, records through `RecordWriter`, the
        IVF of the frozen quantizer with the vectors added in order, search defaults for the
        new count. It ranks exactly as a fresh build of those documents with this encoder state.
        """
        current = self.current()
        number = current.number + 1
        name = f"base-{number:06d}"
        staging = self.live_dir / f"{name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        view = self._view()
        try:
            base = view.base
            store = base.manifest["store"]
            # The stored vectors are pooled already: rewrite them as they are (same storage type).
            layout = dataclasses.replace(StoreLayout.from_manifest(store), pool_factor=1)
            keep = np.flatnonzero(view.live) if view.live is not None else np.arange(current.total)
            if len(keep) == 0:
                raise InvalidParameterError("compact: every document is deleted; an index needs at least one")
            n = len(keep)
            id_width = max(m.ids.dtype.itemsize for m in view.ids.maps)
            records = np.lib.format.open_memmap(staging / "records.npy", mode="w+", dtype=RECORD_DTYPE, shape=(n,))
            ids = np.lib.format.open_memmap(staging / "ids.npy", mode="w+", dtype=f"S{id_width}", shape=(n,))
            ann = empty_ivf(view.ann)
            reader = open_reader("mmap", view.embeddings, view.records, layout)
            n_bow = 0
            try:
                with RecordWriter(staging / "embeddings.bin", layout) as writer:
                    for at in range(0, n, 4096):
                        numbers = keep[at : at + 4096]
                        data = reader.read(numbers)
                        counts = np.diff(data.offsets)
                        records[at : at + len(numbers)] = writer.append(data.cls.numpy(), data.vectors.numpy(), counts)
                        ann.add(data.cls.float().numpy())
                        n_bow += int(counts.sum())
                    file_bytes = writer.close()
            finally:
                reader.close()
            _checkpoint("compact-records")
            self._copy_ids_and_docs(view, keep, ids, staging)
            columns = _columns_from_docs(staging, n)
            records.flush()
            ids.flush()
            del records
            np.save(staging / "ids_sorted.npy", np.argsort(ids, kind="stable"))
            del ids
            faiss.write_index(ann, str(staging / "ann.faiss"))
            shutil.copytree(base.file("encoder"), staging / "encoder")
            manifest = {key: value for key, value in base.manifest.items() if key != "files"}
            manifest["created"] = _now()
            manifest["counts"] = {"documents": n, "bow_vectors": n_bow}
            manifest["store"] = {**store, "file_bytes": file_bytes}
            manifest["search_defaults"] = default_search_params(int(view.ann.nlist), n)
            manifest.pop("metadata", None)
            if columns is not None:
                manifest["metadata"] = columns
            carried = int(base.manifest.get("compacted", {}).get("added_since_fit", 0))
            from_deltas = int((keep >= current.base_documents).sum())
            manifest["compacted"] = {"from_generation": current.number, "added_since_fit": carried + from_deltas}
        finally:
            view.close()
        write_manifest(staging, manifest)
        compacted_files = ("records.npy", "ids.npy", "ids_sorted.npy", "ann.faiss", "docs_offsets.npy")
        for path in [*(staging / f for f in compacted_files), *(staging / "metadata").glob("*.npy")]:
            fsync_path(path)
        if (staging / "metadata").is_dir():
            fsync_path(staging / "metadata")
        fsync_path(staging)
        _checkpoint("compact-staged")
        final = self.live_dir / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        fsync_path(self.live_dir)
        _checkpoint("compact-renamed")
        self._commit(Generation(number, f"{LIVE_DIR}/{name}", n, file_bytes, (), None, _now()))
        return WriteResult(number)

    def _copy_ids_and_docs(self, view: LiveView, keep: np.ndarray, ids: np.ndarray, staging: Path) -> None:
        """Ids and passages of the kept doc numbers, segment by segment, as byte ranges (no per-doc JSON)."""
        firsts = view.ids.firsts
        seg = np.searchsorted(firsts, keep, side="right") - 1
        offsets = np.zeros(len(keep) + 1, dtype=np.int64)
        at = 0
        with open(staging / "docs.jsonl", "wb") as out:
            for s in range(len(firsts)):
                local = keep[seg == s] - firsts[s]
                if len(local) == 0:
                    continue
                ids[at : at + len(local)] = view.ids.maps[s].ids[local]
                store = view.docs.stores[s]
                blob = np.memmap(store.path, dtype=np.uint8, mode="r")
                for block in range(0, len(local), 65536):  # bounded index arrays, whatever the corpus
                    part = local[block : block + 65536]
                    starts = np.asarray(store.offsets[part], dtype=np.int64)
                    lengths = np.asarray(store.offsets[part + 1], dtype=np.int64) - starts
                    gather = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
                    out.write(blob[gather].tobytes())
                    offsets[at + 1 : at + len(part) + 1] = offsets[at] + np.cumsum(lengths)
                    at += len(part)
                del blob
            out.flush()
            os.fsync(out.fileno())
        np.save(staging / "docs_offsets.npy", offsets)

    # -- recovery and garbage ------------------------------------------------------------
    def _recover(self) -> None:
        """Undo what a crashed writer left unpublished: staging dirs, files of unpublished
        generations, and records appended past the published end of embeddings.bin."""
        current = self.current()
        for path in self.live_dir.iterdir():
            name = path.name
            stale = name.endswith(".tmp") or name == "incoming" or (_number(name) or 0) > current.number
            if stale:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
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
            number = _number(path.name)
            if number is None or number >= current.number:
                continue
            if not _remove_if_unused(path):
                kept.append(Generation.from_json(json.loads(path.read_text())))
        referenced = set().union(*(g.referenced() for g in kept))
        root_in_use = "." in referenced or not _unused(self.root / "manifest.json")
        removed = []
        for path in self.live_dir.iterdir():
            name = f"{LIVE_DIR}/{path.name}"
            if path.name.startswith(("seg-", "deleted-", "base-")) and name not in referenced \
                    and (_number(path.name) or 0) <= current.number:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                removed.append(name)
        if not root_in_use:
            for file in FILES:
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


def _remove_if_unused(path: Path) -> bool:
    """Unlink a generation file unless a reader holds it; under the exclusive lock, so a reader
    locking it afterwards finds it gone and opens the current one instead."""
    return _unused(path, unlink=True)


def _unused(path: Path, unlink: bool = False) -> bool:
    """True when no reader holds a shared lock on `path` (taken and dropped at once; with
    `unlink`, the file is removed while the lock is held)."""
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


def _number(name: str) -> int | None:
    stem = name.split(".")[0]
    head, _, digits = stem.rpartition("-")
    return int(digits) if head in ("gen", "seg", "deleted", "base") and digits.isdigit() else None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _columns_from_docs(directory: Path, n_docs: int, block: int = 65536) -> dict[str, Any] | None:
    """Metadata columns of a compacted base from its docs.jsonl (which carries every document's
    metadata), read in bounded blocks of lines; returns the manifest's `metadata` section."""
    writer = MetadataWriter(directory, n_docs)
    offsets = np.load(directory / "docs_offsets.npy")
    blob = np.memmap(directory / "docs.jsonl", dtype=np.uint8, mode="r") if offsets[-1] else np.zeros(0, np.uint8)
    for first in range(0, n_docs, block):
        bounds = offsets[first : min(first + block, n_docs) + 1].tolist()
        data = blob[bounds[0] : bounds[-1]].tobytes()
        add_from_passages(writer, (data[a - bounds[0] : b - bounds[0]] for a, b in zip(bounds[:-1], bounds[1:])), first)
    del blob
    return writer.finish()


def _with_metadata(line: bytes, metadata: dict[str, Any]) -> bytes:
    if not metadata:
        return line
    obj = json.loads(line)
    obj["metadata"] = metadata
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


def _validate_documents(documents: Sequence[NewDocument]) -> None:
    seen: set[str] = set()
    for i, d in enumerate(documents):
        if not isinstance(d.doc_id, str) or not d.doc_id.strip() or d.doc_id != d.doc_id.strip():
            raise InvalidParameterError(f"document {i}: id must be a non-empty string without surrounding spaces")
        if len(d.doc_id.encode("utf-8")) > MAX_ID_BYTES or any(c in d.doc_id for c in "\t\n\r"):
            raise InvalidParameterError(f"document {i}: id must be at most {MAX_ID_BYTES} bytes, no tabs or newlines")
        if d.doc_id in seen:
            raise ConflictError(f"document id {d.doc_id!r} appears twice in one write")
        seen.add(d.doc_id)
        if not isinstance(d.text, str) or not isinstance(d.title, str):
            raise InvalidParameterError(f"document {d.doc_id!r}: title and text must be strings")
        if not (d.text.strip() or d.title.strip()):
            raise InvalidParameterError(f"document {d.doc_id!r}: text is empty")
        if len(d.text) + len(d.title) > MAX_TEXT_CHARS:
            raise InvalidParameterError(f"document {d.doc_id!r}: title and text hold {len(d.text) + len(d.title)} "
                                        f"characters; at most {MAX_TEXT_CHARS}")
        try:
            check_metadata(d.metadata)
        except ValueError as exc:
            raise InvalidParameterError(f"document {d.doc_id!r}: {exc}") from None


def iter_ids_file(path: Path) -> Iterator[str]:
    """Ids one per line (blank lines skipped), for `espn delete --ids-file`."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield line.strip()


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
            "live_documents": g.live_documents, "fitted_on_documents": fitted_on,
            "added_since_fit": added, "drift": round(drift, 4), "rebuild_recommended": drift > DRIFT_REBUILD}
