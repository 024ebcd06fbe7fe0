"""A compaction's base rewrite: a new base from the live documents of a snapshot, written and
fitted by the writer the build uses (espn.live.base_segment), then swapped in with what was
published meanwhile carried over, coded and listed as the new base codes and lists its own
(see espn.live.compaction)."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from ..ann import load_ivf
from ..files.checksums import sha256_file
from ..files.clock import utc_now
from ..files.crash_points import checkpoint
from ..files.durable import fsync_path, fsync_tree
from ..generation.format import LIVE_DIR, ByteRange, Generation, SegmentInfo, read_tombstones
from ..generation.segments import LiveView, empty_ivf, open_view
from ..index import PROJECTION_FILE, IndexDirectory, write_manifest
from ..pages.images import copy_page_images
from ..pages.stored import open_index_images
from ..pooling.groups import copy_pool_groups
from ..pooling.spans import open_index_groups
from ..store import open_reader
from ..store.format import RECORD_DTYPE, RecordWriter, StoreLayout
from ..store.projection import base_projection, project
from ..store.recode import written_before_centroids
from .base_segment import BaseSegmentWriter
from .fitting import Fit
from .merging import columns_from_docs, merge_segments, side_on_swap
from .side_index import SwapSource
from .writer import IndexWriter

__all__ = ["rewrite", "write_base", "link_tree"]

log = logging.getLogger(__name__)


def rewrite(writer: IndexWriter, view: LiveView, staging: Path, wait_s: float,
            swap: Callable[[Callable[[], int]], int], progress: Callable[[int, int], None] | None = None) -> int:
    snapshot = view.generation
    out = staging / "base"
    keep = write_base(view, out, progress)
    for index in writer.side_indexes:  # the new base's own side indexes (text), built before the swap
        index.on_rewrite(out)
    checkpoint("compact-staged")
    return swap(lambda: _carry(writer, snapshot, keep, view.live, staging, wait_s))


def _carry(writer: IndexWriter, snapshot: Generation, keep: np.ndarray, live_mask: np.ndarray | None,
           staging: Path, wait_s: float) -> int:
    """The swap of a base rewrite, under the writer lock: what was published since the
    snapshot moves onto the new base (staging/base), which then becomes current."""
    out = staging / "base"
    n = len(keep)
    base_bytes = (out / "embeddings.bin").stat().st_size
    with writer.locked(wait_s) as current:
        checkpoint("swap")
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
            merged = _carry_segments(writer, carried, staging, snapshot.total, since[since >= snapshot.total], shift)
            end = merged.records[-1].stop
            segments = (merged,)
        checkpoint("swap-carried")

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
        checkpoint("swap-renamed")
        chain = (writer.write_tombstones(translated, number),) if len(translated) else ()
        manifest = IndexDirectory.open(writer.live_dir / name, verify="none").manifest
        carried_dirs = {segments[0].first: writer.live_dir / segments[0].name} if carried else {}
        side = side_on_swap(writer, current, number, renumber,
                             SwapSource(writer.live_dir / name, carried_dirs, translated))
        number = writer.commit(Generation(number, f"{LIVE_DIR}/{name}", n, end, segments, chain, utc_now(),
                                          dict(manifest["files"]), side)).number
    log.info("rewrote the base: %d documents (%d carried over from writes during the rewrite)", n,
             sum(s.documents for s in segments))
    return number


def _carry_segments(writer: IndexWriter, carried: list[SegmentInfo], staging: Path, since_total: int,
                    dead: np.ndarray, shift: int) -> SegmentInfo:
    """The deltas published during the rewrite, as one delta of the new base (staging/base):
    their records read back and written again as the new base codes them (it was fitted anew:
    another residual codec, perhaps another storage type), appended to its embeddings.bin, and
    their IVF entries listed under its new quantizer. Called under the writer lock."""
    out = staging / "base"
    new_store = IndexDirectory.open(out, verify="none").manifest["store"]
    new = StoreLayout.from_manifest(new_store, out)
    new = dataclasses.replace(new, pool_factor=1)  # the records hold pooled vectors: written as they are
    view = open_view(writer.root, verify="none")  # the current generation: the writer lock keeps it
    numbers = np.arange(since_total, view.generation.total, dtype=np.int64)
    table = np.zeros(len(numbers), dtype=RECORD_DTYPE)
    ann = empty_ivf(load_ivf(out / "ann.faiss"))
    start = (out / "embeddings.bin").stat().st_size
    stored = dataclasses.replace(StoreLayout.from_manifest(view.base.manifest["store"], view.base.path), pool_factor=1)
    # The first fitted base of an index created empty projects its vectors: so do the carried ones.
    projection = base_projection(out, new_store) if stored.d_bow != new.d_bow else None
    reader = open_reader("mmap", view.embeddings, view.records, stored)  # type: ignore[arg-type]
    try:
        with RecordWriter(out / "embeddings.bin", new, resume_at=start) as records_out:
            for at in range(0, len(numbers), 4096):
                part = numbers[at : at + 4096]
                data = reader.read(part)
                vectors = data.vectors.numpy() if projection is None else project(data.vectors.numpy(), projection)
                table[at : at + len(part)] = records_out.append(data.cls.numpy(), vectors, np.diff(data.offsets))
                alive = ~np.isin(part, dead)
                ann.add_with_ids(np.ascontiguousarray(data.cls.numpy()[alive], dtype=np.float32), part[alive] + shift)
            end = records_out.close()
    finally:
        reader.close()
        view.close()
    moved = ByteRange(start, end, sha256_file(out / "embeddings.bin", start, end))
    return merge_segments(writer, carried, staging / "carry", dead=dead, first=since_total + shift, id_shift=shift,
                          records=(moved,), table=table, ann=ann)


def write_base(view: LiveView, out: Path, progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """A complete index directory at `out` from the live documents of `view`, written as the build
    writes one (espn.live.base_segment): live documents in doc-number order, then fitted on those
    documents (the IVF, the first stage, residual codes; exact while an index created empty is
    small), search defaults for the new count. Returns the doc numbers kept ([n] int64, sorted).
    progress(done, total): documents written so far."""
    snapshot = view.generation
    out.mkdir()
    base = view.base
    store = base.manifest["store"]
    if "projection" in store:  # fitted once: the records stay projected (espn.store.projection)
        os.link(base.path / store["projection"], out / PROJECTION_FILE)
    # The stored vectors are pooled already: they are read, and written again, as they are.
    stored = dataclasses.replace(StoreLayout.from_manifest(store, base.path), pool_factor=1)
    fit = Fit.from_manifest(base.manifest)
    keep = np.flatnonzero(view.live) if view.live is not None else np.arange(snapshot.total)
    n = len(keep)
    # Residual records are coded against the centroids this base fits: int8 until then.
    written = written_before_centroids(dataclasses.replace(stored, dtype=fit.for_documents(n).dtype, codec=None))
    id_width = max([m.ids.dtype.itemsize for m in view.ids.maps] + [1])
    with BaseSegmentWriter(out, written, n, id_width, str(base.path)) as writer:
        _copy_records(view, keep, stored, writer, progress)
        checkpoint("compact-records")
        copy_pool_groups(open_index_groups(view.base, view), keep, out)  # listed by write_manifest
        copy_page_images(open_index_images(view.base, view), keep, out)  # likewise
        _copy_ids_and_docs(view, keep, writer)
        fitted = writer.finish(fit, pool_factor=store.get("pool_factor", 1))
    columns = columns_from_docs(out, n)
    link_tree(base.file("encoder"), out / "encoder")  # stored once per index: every base shares its bytes
    manifest = {key: value for key, value in base.manifest.items() if key not in ("files", "metadata", "first_stage")}
    manifest["created"] = utc_now()
    manifest["counts"] = {"documents": n, "bow_vectors": writer.n_bow}
    manifest["store"] = {**{key: value for key, value in store.items() if key != "residual"}, **fitted["store"]}
    for section in ("ann", "fit", "search_defaults"):
        manifest[section] = fitted[section]
    if fitted["first_stage"] is not None:
        manifest["first_stage"] = fitted["first_stage"]
    if columns is not None:
        manifest["metadata"] = columns
    manifest["compacted"] = {"from_generation": snapshot.number}
    write_manifest(out, manifest)
    fsync_tree(out)
    return keep


def _copy_records(view: LiveView, keep: np.ndarray, stored: StoreLayout, writer: BaseSegmentWriter,
                  progress: Callable[[int, int], None] | None) -> None:
    """The records of the kept doc numbers into the new base, in order. Records stored as the new
    base stores them are copied byte for byte (never decoded and coded again, which would round
    them a second time at each rewrite); others are coded anew."""
    n = len(keep)
    reader = open_reader("mmap", view.embeddings, view.records, stored)  # type: ignore[arg-type]
    as_stored = writer.layout.dtype == stored.dtype and writer.layout.codec is None
    source = np.memmap(view.embeddings, dtype=np.uint8, mode="r") if as_stored and n else None
    try:
        for at in range(0, n, 4096):
            part = keep[at : at + 4096]
            data = reader.read(part)
            if source is not None:
                table = view.records[part]
                writer.append_stored(_gather(source, table["offset"], table["length"]), table["length"], table["n_bow"],
                                     data.cls.numpy())
            else:
                writer.append(data.cls.numpy(), data.vectors.numpy(), np.diff(data.offsets))
            if progress is not None:
                progress(at + len(part), n)
    finally:
        reader.close()
        source = None  # the mapping of the snapshot's records goes with it


def _gather(blob: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The byte ranges [offset, offset + length) of `blob`, one after the other."""
    offsets, lengths = np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    return blob[np.repeat(offsets - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))]


def link_tree(source: Path, target: Path) -> tuple[int, int]:
    """`target` (new) as a copy of the directory `source` whose files are hard links to
    `source`'s: an encoder of 87 MB is stored once however many bases an index has rewritten
    (the files are immutable; the manifests checksum them as before). Files are copied where
    the filesystem cannot link. Links in `source` are copied as links (copytree's default).
    Returns (files linked, bytes copied)."""
    linked, copied = 0, 0

    def link_or_copy(src: str, dst: str) -> str:
        nonlocal linked, copied
        try:
            os.link(src, dst, follow_symlinks=False)
            linked += 1
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                raise
            shutil.copy2(src, dst)
            copied += os.path.getsize(dst)
        return dst

    shutil.copytree(source, target, copy_function=link_or_copy)
    return linked, copied


def _copy_ids_and_docs(view: LiveView, keep: np.ndarray, writer: BaseSegmentWriter) -> None:
    """Ids and passages of the kept doc numbers, segment by segment, as byte ranges (no per-doc JSON)."""
    firsts = view.ids.firsts
    seg = np.searchsorted(firsts, keep, side="right") - 1
    for s in range(len(firsts)):
        local = keep[seg == s] - firsts[s]
        if len(local) == 0:
            continue
        ids = view.ids.maps[s].ids
        store = view.docs.stores[s]
        blob = np.memmap(store.path, dtype=np.uint8, mode="r")
        for block in range(0, len(local), 65536):  # bounded index arrays, whatever the corpus
            part = local[block : block + 65536]
            starts = np.asarray(store.offsets[part], dtype=np.int64)
            lengths = np.asarray(store.offsets[part + 1], dtype=np.int64) - starts
            writer.append_passages(ids[part], _gather(blob, starts, lengths).tobytes(), lengths)
        del blob
