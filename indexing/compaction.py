"""Compaction that does not stop the world: tiered merges of deltas, base rewrites from a snapshot.

Two kinds of job (`Plan`), one at a time per index (`live/COMPACT`, an exclusive `flock`):

- *merge*: a run of consecutive small deltas becomes one delta. Doc numbers are kept (a
  document deleted by then stays a hole: no vector in the IVF, no id, no passage), so
  nothing published before or meanwhile needs renumbering, and the tombstones stay valid.
  The records are not copied either: the merged delta's rows point where the sources' did.
- *rewrite*: a new base (a complete index directory, written the way the build writes
  one) from the live documents of every segment, deleted ones dropped. It ranks exactly as
  a fresh build of those documents with this encoder state.

Both work from a snapshot (the generation current when the job starts, held open so its
files stay) in a staging directory, *without* the writer lock: writes go on and publish
generations meanwhile. Only the swap takes the writer lock (the one moment writes wait):
a merge replaces its run of deltas in the then-current generation; a rewrite carries what
was published meanwhile onto the new base: the records appended since the snapshot are
copied to the end of the new embeddings.bin (one contiguous range, block-aligned at both
ends, so every offset shifts by one constant), the deltas published since become one
delta renumbered after the new base's documents, and the deletions made since are
translated to the new doc numbers. Side indexes (live.SideIndex) get `on_swap` there.

`CompactionPolicy` decides when: a merge of the `merge_factor` cheapest consecutive deltas
once there are more than `max_segments`; a rewrite once deltas hold more than
`base_ratio` of the base's documents or more than `max_deleted_fraction` of the doc
numbers are deleted or replaced. Each document is merged O(log n) times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import faiss
import numpy as np

from espn.errors import IndexLockedError, InvalidParameterError
from espn.index import IndexDirectory, fsync_path, sha256_file, write_manifest
from espn.metadata import MetadataWriter, add_from_passages
from espn.segments import (
    LIVE_DIR,
    SEGMENT_FILES,
    ByteRange,
    Generation,
    LiveView,
    SegmentInfo,
    empty_ivf,
    open_view,
    read_tombstones,
)
from espn.store import open_reader
from espn.store.format import RECORD_DTYPE, RecordWriter, StoreLayout
from espn.store.record_order import RECORD_ORDER, reorder_index_records

from . import live
from .first_stage import build_first_stage
from .text_index import install_text_index
from .text_side import SwapSource, TextSide
from .assemble import default_search_params
from .live import LiveIndex, Staging, file_entry, fsync_tree

__all__ = ["Plan", "CompactionPolicy", "CompactionRunningError", "run_compaction"]

log = logging.getLogger(__name__)


class CompactionRunningError(IndexLockedError):
    """Another compaction of this index is running (one at a time)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """kind "merge": the deltas named `segments` (consecutive) become one; "rewrite": a new base."""

    kind: str
    segments: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("merge", "rewrite"):
            raise InvalidParameterError(f"compaction kind must be merge or rewrite, got {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class CompactionPolicy:
    """When compaction pays, and what it does (see the module's docstring)."""

    max_segments: int = 8
    merge_factor: int = 4
    base_ratio: float = 0.5
    max_deleted_fraction: float = 0.2

    def plan(self, generation: Generation) -> Plan | None:
        g = generation
        if not g.segments and not g.tombstones:
            return None
        if (g.deleted_count > self.max_deleted_fraction * max(1, g.total)
                or g.total - g.base_documents > self.base_ratio * max(1, g.base_documents)):
            return Plan("rewrite")
        if len(g.segments) <= self.max_segments:
            return None
        sizes = [s.documents for s in g.segments]
        width = min(max(2, self.merge_factor), len(sizes))
        start = min(range(len(sizes) - width + 1), key=lambda i: (sum(sizes[i : i + width]), -i))
        return Plan("merge", tuple(s.name for s in g.segments[start : start + width]))

    def due(self, generation: Generation) -> bool:
        return self.plan(generation) is not None


@contextlib.contextmanager
def _compaction_lock(live_dir: Path, wait_s: float) -> Iterator[None]:
    live_dir.mkdir(exist_ok=True)
    fd = os.open(live_dir / "COMPACT", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if not live.flock_within(fd, wait_s, longest_pause_s=0.05):
            raise CompactionRunningError(f"{live_dir.parent}: another compaction is running")
        yield
    finally:
        os.close(fd)


def run_compaction(writer: LiveIndex, plan: Plan | None, policy: CompactionPolicy | None = None,
                   wait_s: float = 10.0, compaction_wait_s: float = 0.0,
                   swap: Callable[[Callable[[], int]], int] | None = None) -> int | None:
    """Run `plan` (or the one `policy` picks for the current generation) and swap it in;
    returns the generation published, None when there was nothing to do.

    wait_s: how long the swap waits for the writer lock; compaction_wait_s: how long to
    wait for another compaction to finish (CompactionRunningError after it). swap: runs the
    swap (the part under the writer lock) and returns its result; a server hands it to its
    publishing thread (commit.GroupCommit.run_exclusive), which runs at normal priority
    while the compaction itself runs at a lowered one. Default: run it in this thread.
    """
    swap = swap or (lambda run: run())
    with _compaction_lock(writer.live_dir, compaction_wait_s):
        view = open_view(writer.root, verify="none")  # the snapshot: held, so its files stay
        try:
            snapshot = view.generation
            plan = plan if plan is not None else (policy or CompactionPolicy()).plan(snapshot)
            if plan is None or (plan.kind == "rewrite" and not snapshot.segments and not snapshot.tombstones):
                return None
            with Staging(writer, "compact", wait_s) as staging:
                if plan.kind == "merge":
                    number = _merge(writer, view, plan, staging.path, wait_s, swap)
                else:
                    number = _rewrite(writer, view, staging.path, wait_s, swap)
        finally:
            view.close()
    with contextlib.suppress(IndexLockedError):  # the snapshot's files go now, or at the next write
        with writer.locked(0.0):
            writer.collect_garbage()
    return number


# -- merge ------------------------------------------------------------------------------------

def _merge(writer: LiveIndex, view: LiveView, plan: Plan, staging: Path, wait_s: float,
           swap: Callable[[Callable[[], int]], int]) -> int:
    snapshot = view.generation
    names = [s.name for s in snapshot.segments]
    at = names.index(plan.segments[0]) if plan.segments and plan.segments[0] in names else -1
    if at < 0 or tuple(names[at : at + len(plan.segments)]) != plan.segments:
        raise InvalidParameterError(f"merge: {', '.join(plan.segments)} are not consecutive deltas of generation "
                                    f"{snapshot.number}")
    sources = snapshot.segments[at : at + len(plan.segments)]
    dead = np.flatnonzero(~view.live[sources[0].first : sources[-1].stop]) + sources[0].first \
        if view.live is not None else np.zeros(0, np.int64)
    merged = merge_segments(writer, sources, staging / "seg", dead=dead)
    live._checkpoint("merge-built")

    def do_swap() -> int:
        with writer.locked(wait_s) as current:
            live._checkpoint("swap")
            names = [s.name for s in current.segments]
            if tuple(names[at : at + len(sources)]) != plan.segments:  # only compaction removes deltas, one at a time
                raise RuntimeError(f"merge: the deltas {plan.segments} changed while they were merged")
            number = current.number + 1
            name = f"seg-{number:06d}"
            os.replace(staging / "seg", writer.live_dir / name)
            fsync_path(writer.live_dir)
            live._checkpoint("swap-renamed")
            segments = (*current.segments[:at], dataclasses.replace(merged, name=name),
                        *current.segments[at + len(sources):])
            side = _side_on_swap(writer, current, number, lambda numbers: numbers)
            writer.commit(Generation(number, current.base, current.base_documents, current.embeddings_bytes, segments,
                                     current.tombstones, live._now(), current.base_files, side))
        log.info("merged %d deltas (%d documents) into %s", len(sources), merged.documents, name)
        return number

    return swap(do_swap)


def merge_segments(writer: LiveIndex, sources: Sequence[SegmentInfo], out: Path, *, dead: np.ndarray,
                   first: int | None = None, id_shift: int = 0, records: tuple[ByteRange, ...] | None = None,
                   offset_shift: int = 0) -> SegmentInfo:
    """Consecutive delta segments as one, written to `out` (its `name` is left empty).

    dead: global doc numbers (of the sources) to leave as holes: kept in the numbering, out
    of the IVF, with no id and no passage. first/id_shift: the merged segment's first doc
    number and what is added to its IVF's ids (a rewrite's carry renumbers; a merge does not).
    records/offset_shift: where its records lie (a carry moved them) and the shift of every
    record offset; by default the sources' ranges, unshifted.
    """
    root = writer.root
    first = sources[0].first if first is None else first
    out.mkdir()
    n = sum(s.documents for s in sources)
    parts = [IndexDirectory(root / LIVE_DIR / s.name, {}) for s in sources]
    table = np.concatenate([p.load_array("records.npy") for p in parts])
    table["offset"] += offset_shift
    hole = np.zeros(n, dtype=bool)
    hole[np.asarray(dead, dtype=np.int64) - sources[0].first] = True
    ids = np.concatenate([p.load_array("ids.npy") for p in parts])
    ids[hole] = b""
    np.save(out / "records.npy", table)
    np.save(out / "ids.npy", ids)
    np.save(out / "ids_sorted.npy", np.argsort(ids, kind="stable"))
    _concat_docs(parts, hole, out)
    ann = writer.empty_ivf(writer.current().base)
    for part in parts:
        source = faiss.read_index(str(part.file("ann.faiss")))  # in memory: merge_from moves its entries
        ann.merge_from(faiss.extract_index_ivf(source), id_shift)
    if hole.any():
        ann.remove_ids(faiss.IDSelectorBatch(np.flatnonzero(hole).astype(np.int64) + first))
    faiss.write_index(ann, str(out / "ann.faiss"))
    columns = _columns_from_docs(out, n)
    fsync_tree(out)
    column_files = sorted(str(p.relative_to(out)) for p in (out / "metadata").glob("*.npy"))
    files = {f: file_entry(out / f) for f in [*SEGMENT_FILES, *column_files]}
    ranges = records if records is not None else tuple(r for s in sources for r in s.records)
    return SegmentInfo("", first, n, files, ranges, columns)


def _concat_docs(parts: Sequence[IndexDirectory], hole: np.ndarray, out: Path) -> None:
    """docs.jsonl and docs_offsets.npy of the concatenated segments, holes as empty lines."""
    offsets = np.zeros(len(hole) + 1, dtype=np.int64)
    at = 0
    with open(out / "docs.jsonl", "wb") as f:
        for part in parts:
            source = part.load_array("docs_offsets.npy")
            count = len(source) - 1
            lengths = np.diff(source) * ~hole[at : at + count]
            blob = np.fromfile(part.file("docs.jsonl"), dtype=np.uint8)
            starts = np.asarray(source[:-1], dtype=np.int64)
            keep = lengths > 0
            gather = np.repeat(starts[keep] - (np.cumsum(lengths[keep]) - lengths[keep]), lengths[keep]) + \
                np.arange(int(lengths.sum()))
            f.write(blob[gather].tobytes())
            offsets[at + 1 : at + count + 1] = offsets[at] + np.cumsum(lengths)
            at += count
    np.save(out / "docs_offsets.npy", offsets)


def _columns_from_docs(directory: Path, n_docs: int, block: int = 65536) -> dict[str, Any] | None:
    """Metadata columns of a segment or base from its docs.jsonl (which carries every document's
    metadata), read in bounded blocks of lines; returns the manifest's `metadata` section."""
    writer = MetadataWriter(directory, n_docs)
    offsets = np.load(directory / "docs_offsets.npy")
    blob = np.fromfile(directory / "docs.jsonl", dtype=np.uint8) if offsets[-1] else np.zeros(0, np.uint8)
    for start in range(0, n_docs, block):
        bounds = offsets[start : min(start + block, n_docs) + 1].tolist()
        data = blob[bounds[0] : bounds[-1]].tobytes()
        add_from_passages(writer, (data[a - bounds[0] : b - bounds[0]] for a, b in zip(bounds[:-1], bounds[1:])), start)
    return writer.finish()


def _side_on_swap(writer: LiveIndex, current: Generation, number: int,
                  renumber: Callable[[np.ndarray], np.ndarray], source: SwapSource | None = None) -> dict[str, Any]:
    side = dict(current.side)
    for index in writer.side_indexes:
        side[index.name] = dict(index.on_swap(writer.live_dir, number, current.side.get(index.name), renumber, source))
    return side


# -- rewrite ----------------------------------------------------------------------------------

def _rewrite(writer: LiveIndex, view: LiveView, staging: Path, wait_s: float,
             swap: Callable[[Callable[[], int]], int]) -> int:
    snapshot = view.generation
    out = staging / "base"
    keep = write_base(view, out)
    for index in writer.side_indexes:  # the new base's own text index, built before the swap
        if isinstance(index, TextSide):
            install_text_index(out, index.config)
    live._checkpoint("compact-staged")
    return swap(lambda: _carry(writer, snapshot, keep, view.live, staging, wait_s))


def _carry(writer: LiveIndex, snapshot: Generation, keep: np.ndarray, live_mask: np.ndarray | None,
           staging: Path, wait_s: float) -> int:
    """The swap of a base rewrite, under the writer lock: what was published since the
    snapshot moves onto the new base (staging/base), which then becomes current."""
    out = staging / "base"
    n = len(keep)
    base_bytes = (out / "embeddings.bin").stat().st_size
    with writer.locked(wait_s) as current:
        live._checkpoint("swap")
        names = {s.name for s in current.segments}
        if current.base != snapshot.base or not {s.name for s in snapshot.segments} <= names:
            raise RuntimeError("rewrite: the snapshot's segments changed while the base was rewritten")
        number = current.number + 1
        carried = [s for s in current.segments if s.first >= snapshot.total]
        shift = n - snapshot.total  # doc numbers published since the snapshot move down by this much
        tombstones = read_tombstones(writer.root, current)
        before = np.flatnonzero(~live_mask) if live_mask is not None else np.zeros(0, np.int64)
        since = np.setdiff1d(tombstones, before, assume_unique=True)
        segments: tuple[SegmentInfo, ...] = ()
        end = base_bytes
        if carried:
            added = current.embeddings_bytes - snapshot.embeddings_bytes
            source = writer.root / current.base / "embeddings.bin"
            _copy_range(source, snapshot.embeddings_bytes, current.embeddings_bytes, out / "embeddings.bin")
            end = base_bytes + added
            moved = ByteRange(base_bytes, end, sha256_file(out / "embeddings.bin", base_bytes, end))
            merged = merge_segments(writer, carried, staging / "carry", dead=since[since >= snapshot.total],
                                    first=n, id_shift=shift, records=(moved,), offset_shift=base_bytes - snapshot.embeddings_bytes)
            segments = (merged,)
        live._checkpoint("swap-carried")

        def renumber(numbers: np.ndarray) -> np.ndarray:
            numbers = np.asarray(numbers, dtype=np.int64)
            old = numbers < snapshot.total
            at = np.searchsorted(keep, numbers[old])
            found = (at < len(keep)) & (keep[np.minimum(at, len(keep) - 1)] == numbers[old])
            out_ = numbers + shift
            out_[old] = np.where(found, at, -1)
            return out_

        translated = renumber(since)
        if np.any(translated < 0):
            raise RuntimeError("rewrite: a document deleted since the snapshot was not in it")
        name = f"base-{number:06d}"
        os.replace(out, writer.live_dir / name)
        if carried:
            segments = (dataclasses.replace(segments[0], name=f"seg-{number:06d}"),)
            os.replace(staging / "carry", writer.live_dir / segments[0].name)
        fsync_path(writer.live_dir)
        live._checkpoint("swap-renamed")
        chain = (writer.write_tombstones(translated, number),) if len(translated) else ()
        manifest = IndexDirectory.open(writer.live_dir / name, verify="none").manifest
        carried_dirs = {segments[0].first: writer.live_dir / segments[0].name} if carried else {}
        side = _side_on_swap(writer, current, number, renumber,
                             SwapSource(writer.live_dir / name, carried_dirs, translated))
        writer.commit(Generation(number, f"{LIVE_DIR}/{name}", n, end, segments, chain, live._now(),
                                 dict(manifest["files"]), side))
    log.info("rewrote the base: %d documents (%d carried over from writes during the rewrite)", n,
             sum(s.documents for s in segments))
    return number


def _copy_range(source: Path, start: int, stop: int, target: Path) -> None:
    """Append bytes [start, stop) of `source` to `target` and fsync it."""
    with open(source, "rb") as src, open(target, "ab") as dst:
        src.seek(start)
        left = stop - start
        while left > 0:
            block = src.read(min(left, 1 << 22))
            if not block:
                raise OSError(errno.EIO, f"{source} ends before byte {stop}")
            dst.write(block)
            left -= len(block)
        dst.flush()
        os.fsync(dst.fileno())


def write_base(view: LiveView, out: Path) -> np.ndarray:
    """A complete index directory at `out` from the live documents of `view`, the way the build
    writes one: live documents in doc-number order, records through `RecordWriter`, the IVF
    of the frozen quantizer with the vectors added in order, search defaults for the new
    count. Returns the doc numbers kept ([n] int64, sorted)."""
    snapshot = view.generation
    out.mkdir()
    base = view.base
    store = base.manifest["store"]
    # The stored vectors are pooled already: rewrite them as they are (same storage type).
    layout = dataclasses.replace(StoreLayout.from_manifest(store), pool_factor=1)
    keep = np.flatnonzero(view.live) if view.live is not None else np.arange(snapshot.total)
    if len(keep) == 0:
        raise InvalidParameterError("compact: every document is deleted; an index needs at least one")
    n = len(keep)
    id_width = max(m.ids.dtype.itemsize for m in view.ids.maps)
    records = np.lib.format.open_memmap(out / "records.npy", mode="w+", dtype=RECORD_DTYPE, shape=(n,))
    ids = np.lib.format.open_memmap(out / "ids.npy", mode="w+", dtype=f"S{id_width}", shape=(n,))
    ann = empty_ivf(view.ann)
    reader = open_reader("mmap", view.embeddings, view.records, layout)  # type: ignore[arg-type]
    n_bow = 0
    try:
        with RecordWriter(out / "embeddings.bin", layout) as writer:
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
    live._checkpoint("compact-records")
    _copy_ids_and_docs(view, keep, ids, out)
    columns = _columns_from_docs(out, n)
    records.flush()
    ids.flush()
    del records
    np.save(out / "ids_sorted.npy", np.argsort(ids, kind="stable"))
    del ids
    faiss.write_index(ann, str(out / "ann.faiss"))
    file_bytes = reorder_index_records(out, layout.block_size)  # each IVF list's records together, as a build
    shutil.copytree(base.file("encoder"), out / "encoder")
    previous_stage = base.manifest.get("first_stage")
    # The centroid index is retrained on the kept documents, as a fresh build would.
    first_stage = build_first_stage(out, np.load(out / "records.npy", mmap_mode="r"), layout,
                                    previous_stage["kind"], previous=previous_stage) if previous_stage else None
    manifest = {key: value for key, value in base.manifest.items() if key != "files"}
    manifest["created"] = live._now()
    manifest["counts"] = {"documents": n, "bow_vectors": n_bow}
    manifest["store"] = {**store, "file_bytes": file_bytes, "record_order": RECORD_ORDER}
    manifest["search_defaults"] = default_search_params(int(view.ann.nlist), n)
    manifest.pop("metadata", None)
    manifest.pop("first_stage", None)
    if first_stage is not None:
        manifest["first_stage"] = first_stage
    if columns is not None:
        manifest["metadata"] = columns
    carried = int(base.manifest.get("compacted", {}).get("added_since_fit", 0))
    from_deltas = int((keep >= snapshot.base_documents).sum())
    manifest["compacted"] = {"from_generation": snapshot.number, "added_since_fit": carried + from_deltas}
    write_manifest(out, manifest)
    fsync_tree(out)
    return keep


def _copy_ids_and_docs(view: LiveView, keep: np.ndarray, ids: np.ndarray, out: Path) -> None:
    """Ids and passages of the kept doc numbers, segment by segment, as byte ranges (no per-doc JSON)."""
    firsts = view.ids.firsts
    seg = np.searchsorted(firsts, keep, side="right") - 1
    offsets = np.zeros(len(keep) + 1, dtype=np.int64)
    at = 0
    with open(out / "docs.jsonl", "wb") as f:
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
                f.write(blob[gather].tobytes())
                offsets[at + 1 : at + len(part) + 1] = offsets[at] + np.cumsum(lengths)
                at += len(part)
            del blob
        f.flush()
        os.fsync(f.fileno())
    np.save(out / "docs_offsets.npy", offsets)
