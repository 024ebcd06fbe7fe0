"""The files one publish writes: a delta segment (its records appended to the base's
embeddings.bin) and a tombstone file. Called by the writer under its lock."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Callable, Sequence

import faiss
import numpy as np

from ..files.checksums import file_entry, sha256_file
from ..files.crash_points import checkpoint
from ..files.durable import fsync_path, fsync_tree
from ..mapped import read_npy
from ..metadata import DIRECTORY as METADATA_DIR
from ..metadata import MetadataWriter, add_from_passages
from ..pages.images import present_image_files, write_page_images
from ..pooling.groups import present_group_files
from ..generation.format import SEGMENT_FILES, ByteRange, Generation, SegmentInfo, TombstoneFile
from ..errors import ConflictError
from ..index import IndexDirectory
from ..store.format import RecordWriter, StoreLayout, stored_cls
from ..store.projection import base_projection, project

from .encoding import EncodedDocuments
from .resolve import IndexState

__all__ = ["write_delta", "add_tombstones", "write_tombstones", "bow_as_stored", "projection_sha", "TOMBSTONE_MERGE_MAX"]

#: A tombstone file is merged into the next one while the result stays this small (entries),
#: so a chain of single deletes costs a few small files, not one file per delete.
TOMBSTONE_MERGE_MAX = 8192


def write_delta(live_dir: Path, number: int, current: Generation, state: IndexState, documents: EncodedDocuments,
                empty_ivf: Callable[[str], faiss.IndexIVF]) -> SegmentInfo:
    """Records appended to the base's embeddings.bin; the rest in live/seg-NNNNNN.
    empty_ivf(base): an IVF with the base's quantizer and empty lists."""
    base = state.base
    # pooling and storage type as the build's; residual records against the base's centroids
    layout = StoreLayout.from_manifest(base.manifest["store"], base.path)
    if documents.stored:  # vectors read back from an index's records: pooled already, written as they are
        layout = dataclasses.replace(layout, pool_factor=1)
    n = len(documents)
    name = f"seg-{number:06d}"
    staging = live_dir / f"{name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    first = current.total
    writer = MetadataWriter(staging, n)
    add_from_passages(writer, documents.lines)
    columns = writer.finish()
    start = current.embeddings_bytes
    # Truncates any unpublished tail first (a crashed writer's), then appends block-aligned.
    with RecordWriter(base.file("embeddings.bin"), layout, resume_at=start, groups_dir=staging) as records_out:
        records = records_out.append(documents.cls, bow_as_stored(documents, base), documents.counts)
        stop = records_out.close()
    checkpoint("appended")
    _write_segment_arrays(staging, documents, records)
    if documents.images is not None:  # a page index keeps the pages' images (espn.pages.images)
        write_page_images(staging, documents.images, documents.grids)
    ann = empty_ivf(current.base)
    ann.add_with_ids(stored_cls(documents.cls, layout), np.arange(first, first + n, dtype=np.int64))  # as stored
    faiss.write_index(ann, str(staging / "ann.faiss"))
    fsync_tree(staging)
    final = live_dir / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    fsync_path(live_dir)
    checkpoint("segment")
    column_files = sorted(str(p.relative_to(final)) for p in (final / METADATA_DIR).glob("*.npy"))
    group_files = present_group_files(final)  # pooling groups (espn.pooling.groups), when records are pooled
    image_files = present_image_files(final)
    files = {f: file_entry(final / f) for f in [*SEGMENT_FILES, *column_files, *group_files, *image_files]}
    appended = ByteRange(start, stop, sha256_file(base.file("embeddings.bin"), start, stop))
    return SegmentInfo(name, first, n, files, (appended,), columns)


def projection_sha(base: IndexDirectory) -> str | None:
    """The sha256 of the projection `base` stores its token vectors through (None: none)."""
    name = base.manifest["store"].get("projection")
    return None if name is None else str(base.manifest["files"][name]["sha256"])


def bow_as_stored(documents: EncodedDocuments, base: IndexDirectory) -> np.ndarray:
    """The documents' BOW vectors in the space `base` stores them in: the model's own vectors go
    through its projection where it has one (an index created empty, once fitted); vectors stored
    through a projection (a move's) must have been through the same one."""
    mine = projection_sha(base)
    if documents.projection == mine:
        return documents.bow
    if documents.projection is None:
        projection = base_projection(base.path, base.manifest["store"])
        assert projection is not None  # mine is not None
        if documents.bow.shape[1] != len(projection):
            raise ConflictError(f"these documents' token vectors have {documents.bow.shape[1]} dimensions; this index "
                                f"projects the model's {len(projection)}")
        return project(documents.bow, projection).astype(documents.bow.dtype)
    raise ConflictError("these documents' stored vectors were projected by another index's fitted projection; "
                        "write them again from their text (each index created empty fits its own)")


def _write_segment_arrays(directory: Path, documents: EncodedDocuments, records: np.ndarray) -> None:
    """records.npy, the id maps and the passages of a delta segment."""
    ids = np.array([i.encode("utf-8") for i in documents.ids], dtype=bytes)
    np.save(directory / "records.npy", records)
    np.save(directory / "ids.npy", ids)
    np.save(directory / "ids_sorted.npy", np.argsort(ids, kind="stable"))
    offsets = np.zeros(len(documents) + 1, dtype=np.int64)
    np.cumsum([len(line) for line in documents.lines], out=offsets[1:])
    (directory / "docs.jsonl").write_bytes(b"".join(documents.lines))
    np.save(directory / "docs_offsets.npy", offsets)


def add_tombstones(live_dir: Path, chain: Sequence[TombstoneFile], numbers: np.ndarray,
                   number: int) -> tuple[TombstoneFile, ...]:
    """A tombstone file for `numbers` (deleted or replaced doc numbers), merged with the
    newest files while they are no larger than it and the result stays small: a chain of
    single deletes leaves O(log n) files, and each delete writes a few bytes."""
    if len(numbers) == 0:
        return tuple(chain)
    chain = list(chain)
    merged = np.asarray(numbers, dtype=np.int64)
    while chain and chain[-1].count <= len(merged) and chain[-1].count + len(merged) <= TOMBSTONE_MERGE_MAX:
        older = read_npy(live_dir / chain.pop().file)
        merged = np.union1d(older, merged)
    return (*chain, write_tombstones(live_dir, merged, number))


def write_tombstones(live_dir: Path, numbers: np.ndarray, number: int) -> TombstoneFile:
    """live/tomb-NNNNNN.npy holding `numbers` (sorted int64), fsynced."""
    name = f"tomb-{number:06d}.npy"
    path = live_dir / name
    with open(path, "wb") as f:
        np.save(f, np.sort(np.asarray(numbers, dtype=np.int64)))
        f.flush()
        os.fsync(f.fileno())
    checkpoint("tombstones")
    entry = file_entry(path)
    return TombstoneFile(name, len(numbers), entry["bytes"], entry["sha256"])
