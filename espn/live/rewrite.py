"""A compaction's base rewrite: a new base from the live documents of a snapshot, written the
way the build writes one, then swapped in with what was published meanwhile carried over
(see espn.live.compaction)."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import faiss
import numpy as np

from espn.errors import InvalidParameterError
from espn.files import checkpoint, fsync_path, fsync_tree, sha256_file, utc_now
from ..first_stage.build import build_first_stage
from espn.index import IndexDirectory, write_manifest
from espn.mapped import map_npy
from espn.params import default_search_params
from ..pages.images import copy_page_images
from ..pooling.groups import copy_pool_groups
from ..generation.format import LIVE_DIR, ByteRange, Generation, SegmentInfo, read_tombstones
from ..generation.segments import LiveView, empty_ivf
from espn.store import open_reader
from espn.store.format import RECORD_DTYPE, RecordWriter, StoreLayout
from espn.store.recode import recode_residual, written_before_centroids
from espn.store.record_order import RECORD_ORDER, reorder_index_records
from ..pages.stored import open_index_images
from ..pooling.spans import open_index_groups

from .merging import columns_from_docs, merge_segments, side_on_swap
from .side_index import SwapSource
from .writer import IndexWriter

__all__ = ["rewrite", "write_base", "link_tree"]

log = logging.getLogger(__name__)


def rewrite(writer: IndexWriter, view: LiveView, staging: Path, wait_s: float,
             swap: Callable[[Callable[[], int]], int]) -> int:
    snapshot = view.generation
    out = staging / "base"
    keep = write_base(view, out)
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
            added = current.embeddings_bytes - snapshot.embeddings_bytes
            source = writer.root / current.base / "embeddings.bin"
            _copy_range(source, snapshot.embeddings_bytes, current.embeddings_bytes, out / "embeddings.bin")
            end = base_bytes + added
            moved = ByteRange(base_bytes, end, sha256_file(out / "embeddings.bin", base_bytes, end))
            merged = merge_segments(writer, carried, staging / "carry", dead=since[since >= snapshot.total],
                                    first=n, id_shift=shift, records=(moved,), offset_shift=base_bytes - snapshot.embeddings_bytes)
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
    layout = dataclasses.replace(StoreLayout.from_manifest(store, base.path), pool_factor=1)
    # Residual records are coded against the centroids this rewrite retrains: int8 until then.
    written = written_before_centroids(layout)
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
        with RecordWriter(out / "embeddings.bin", written) as writer:
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
    checkpoint("compact-records")
    copy_pool_groups(open_index_groups(view.base, view), keep, out)  # listed by write_manifest
    copy_page_images(open_index_images(view.base, view), keep, out)  # likewise
    _copy_ids_and_docs(view, keep, ids, out)
    columns = columns_from_docs(out, n)
    records.flush()
    ids.flush()
    del records
    np.save(out / "ids_sorted.npy", np.argsort(ids, kind="stable"))
    del ids
    faiss.write_index(ann, str(out / "ann.faiss"))
    file_bytes = reorder_index_records(out, layout.block_size)  # each IVF list's records together, as a build
    link_tree(base.file("encoder"), out / "encoder")  # stored once per index: every base shares its bytes
    previous_stage = base.manifest.get("first_stage")
    # The centroid index is retrained on the kept documents, as a fresh build would.
    first_stage = build_first_stage(out, map_npy(out / "records.npy"), written,
                                    previous_stage["kind"], previous=previous_stage) if previous_stage else None
    stored = {**store}
    if layout.bits:
        recoded, file_bytes = recode_residual(out, written, layout.dtype)
        stored = {**store, **recoded.manifest(), "pool_factor": store.get("pool_factor", 1)}
    manifest = {key: value for key, value in base.manifest.items() if key != "files"}
    manifest["created"] = utc_now()
    manifest["counts"] = {"documents": n, "bow_vectors": n_bow}
    manifest["store"] = {**stored, "file_bytes": file_bytes, "record_order": RECORD_ORDER}
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
