"""Records laid out in IVF-list order, so the candidates of a probed list lie close together.

A query's candidates come from the lists it probes. With records in doc-number order they
are scattered over the whole file and every candidate costs its own read; with the records
of each list stored together (list 0's documents, then list 1's, ...), candidates that
one list contributes are near each other and the planner (`plan_extents`) merges those
that share or touch blocks into one read. Doc numbers do not change: records.npy gives
each document's offset, so only the file and that table are rewritten, and every reader
works unchanged.

The build (`indexing.assemble`) and compaction call `reorder_index_records` on a finished
index directory before its manifest is written.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import faiss
import numpy as np

from ..mapped import map_npy
from .format import RECORD_DTYPE, place_records

__all__ = ["ivf_list_order", "write_in_order", "reorder_index_records", "RECORD_ORDER"]

logger = logging.getLogger(__name__)

#: The manifest's `store.record_order` for files written by `reorder_index_records`.
RECORD_ORDER = "ivf_lists"
#: Output written per call: the window a rewrite holds in RAM.
WINDOW_BYTES = 64 << 20


def ivf_list_order(index: faiss.Index) -> np.ndarray:
    """[N] int64 every doc number once: the ids of list 0, then list 1, ... (within a list,
    in the list's own order). N = index.ntotal; ids outside [0, N) are refused."""
    ivf = faiss.extract_index_ivf(index)
    invlists = ivf.invlists
    assert invlists is not None, "an IVF index always has inverted lists"
    parts = []
    for lst in range(ivf.nlist):  # one call per list, not per document
        size = invlists.list_size(lst)
        if size:
            parts.append(faiss.rev_swig_ptr(invlists.get_ids(lst), size).copy())
    order = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    n = int(ivf.ntotal)
    if len(order) != n or (n and (order.min() < 0 or order.max() >= n)) or \
            np.bincount(order, minlength=n).max(initial=1) != 1:
        raise ValueError(f"the IVF's lists do not hold each of its {n} doc numbers once")
    return order


def write_in_order(source: Path, records: np.ndarray, order: np.ndarray, block_size: int,
                   dest: Path) -> tuple[np.ndarray, int]:
    """Copy the records of `source` into `dest` in `order`, placed as `RecordWriter` places them.

    records: RECORD_DTYPE [N] (offsets in `source`); order: [N] doc numbers, each once.
    Returns (the new records [N] by doc number, dest's size: whole blocks). Reads go through
    a memory map of the source; the destination is written sequentially in windows of
    WINDOW_BYTES and fsynced. A build-time pass: the loop copies one record per iteration.
    """
    lengths = np.asarray(records["length"], dtype=np.int64)
    offsets, end = place_records(lengths[order], block_size)
    size = -(-end // block_size) * block_size
    out = np.array(records, dtype=RECORD_DTYPE, copy=True)
    out["offset"][order] = offsets
    src = np.memmap(source, dtype=np.uint8, mode="r")
    old = np.asarray(records["offset"], dtype=np.int64)
    with open(dest, "wb") as file:
        start = 0
        while start < len(order):
            # From this window's first record to its last one's end: the gaps between windows
            # (block padding) are never written, so they read as zeros in the new file.
            base = int(offsets[start])
            stop = max(int(np.searchsorted(offsets, base + WINDOW_BYTES, side="left")), start + 1)
            top = int(offsets[stop - 1] + lengths[order[stop - 1]])
            window = np.zeros(top - base, dtype=np.uint8)
            for doc, at in zip(order[start:stop].tolist(), (offsets[start:stop] - base).tolist()):
                window[at: at + int(lengths[doc])] = src[int(old[doc]): int(old[doc] + lengths[doc])]
            file.seek(base)
            file.write(window.tobytes())
            start = stop
        file.truncate(size)
        file.flush()
        os.fsync(file.fileno())
    del src
    return out, size


def reorder_index_records(directory: Path, block_size: int) -> int:
    """Rewrite `directory`'s embeddings.bin in the IVF-list order of its ann.faiss and update
    records.npy to match (each replaced by rename once written). Returns the new file size."""
    directory = Path(directory)
    index = faiss.read_index(str(directory / "ann.faiss"), faiss.IO_FLAG_MMAP)
    order = ivf_list_order(index)
    del index
    records = map_npy(directory / "records.npy")
    if len(order) != len(records):
        raise ValueError(f"{directory}: ann.faiss holds {len(order)} documents, records.npy {len(records)}")
    target = directory / "embeddings.bin"
    if len(records) == 0:  # nothing to order (an index created empty)
        return target.stat().st_size
    staged = directory / "embeddings.bin.ordered"
    new_records, size = write_in_order(target, records, order, block_size, staged)
    del records
    staged_records = directory / "records.npy.ordered"
    with open(staged_records, "wb") as file:
        np.save(file, new_records)
        file.flush()
        os.fsync(file.fileno())
    os.replace(staged, target)
    os.replace(staged_records, directory / "records.npy")
    logger.info("records of %s laid out in IVF-list order (%d documents, %.1f MB)", directory, len(order), size / 1e6)
    return size
