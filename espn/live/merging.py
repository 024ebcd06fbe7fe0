"""Merging consecutive delta segments into one (a compaction's merge, and the carry-over of a
base rewrite), and the side indexes' part of a compaction's swap."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import faiss
import numpy as np

from espn.files.checksums import file_entry
from espn.files.durable import fsync_tree
from espn.index import IndexDirectory
from espn.mapped import read_npy
from espn.metadata import MetadataWriter, add_from_passages
from ..pages.images import concat_page_images
from ..pooling.groups import concat_pool_groups
from ..generation.format import LIVE_DIR, SEGMENT_FILES, ByteRange, Generation, SegmentInfo

from .side_index import SwapSource
from .writer import IndexWriter

__all__ = ["merge_segments", "columns_from_docs", "side_on_swap"]


def merge_segments(writer: IndexWriter, sources: Sequence[SegmentInfo], out: Path, *, dead: np.ndarray,
                   first: int | None = None, id_shift: int = 0, records: tuple[ByteRange, ...] | None = None,
                   offset_shift: int = 0, table: np.ndarray | None = None,
                   ann: faiss.IndexIVF | None = None) -> SegmentInfo:
    """Consecutive delta segments as one, written to `out` (its `name` is left empty).

    dead: global doc numbers (of the sources) to leave as holes: kept in the numbering, out
    of the IVF, with no id and no passage. first/id_shift: the merged segment's first doc
    number and what is added to its IVF's ids (a rewrite's carry renumbers; a merge does not).
    records/offset_shift: where its records lie (a carry moved them) and the shift of every
    record offset; by default the sources' ranges, unshifted. table/ann: the records' rows and
    the IVF when the carry wrote them anew (a base fitted again codes and lists them its way).
    """
    root = writer.root
    first = sources[0].first if first is None else first
    out.mkdir()
    n = sum(s.documents for s in sources)
    parts = [IndexDirectory(root / LIVE_DIR / s.name, {}) for s in sources]
    if table is None:
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
    group_files = concat_pool_groups([p.path for p in parts], [s.documents for s in sources], out)
    image_files = concat_page_images([p.path for p in parts], [s.documents for s in sources], out, holes=hole)
    if ann is None:
        ann = writer.empty_ivf(writer.current().base)
        for part in parts:
            source = faiss.read_index(str(part.file("ann.faiss")))  # in memory: merge_from moves its entries
            ann.merge_from(faiss.extract_index_ivf(source), id_shift)
        if hole.any():
            ann.remove_ids(faiss.IDSelectorBatch(np.flatnonzero(hole).astype(np.int64) + first))
    faiss.write_index(ann, str(out / "ann.faiss"))
    columns = columns_from_docs(out, n)
    fsync_tree(out)
    column_files = sorted(str(p.relative_to(out)) for p in (out / "metadata").glob("*.npy"))
    files = {f: file_entry(out / f) for f in [*SEGMENT_FILES, *column_files, *group_files, *image_files]}
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


def columns_from_docs(directory: Path, n_docs: int, block: int = 65536) -> dict[str, Any] | None:
    """Metadata columns of a segment or base from its docs.jsonl (which carries every document's
    metadata), read in bounded blocks of lines; returns the manifest's `metadata` section."""
    writer = MetadataWriter(directory, n_docs)
    offsets = read_npy(directory / "docs_offsets.npy")
    blob = np.fromfile(directory / "docs.jsonl", dtype=np.uint8) if offsets[-1] else np.zeros(0, np.uint8)
    for start in range(0, n_docs, block):
        bounds = offsets[start : min(start + block, n_docs) + 1].tolist()
        data = blob[bounds[0] : bounds[-1]].tobytes()
        add_from_passages(writer, (data[a - bounds[0] : b - bounds[0]] for a, b in zip(bounds[:-1], bounds[1:])), start)
    return writer.finish()


def side_on_swap(writer: IndexWriter, current: Generation, number: int,
                  renumber: Callable[[np.ndarray], np.ndarray], source: SwapSource | None = None) -> dict[str, Any]:
    side = dict(current.side)
    for index in writer.side_indexes:
        side[index.name] = dict(index.on_swap(writer.live_dir, number, current.side.get(index.name), renumber, source))
    return side
