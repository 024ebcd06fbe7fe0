"""The one writer of a base segment's files: records, ids and passages in doc-number order, a
table of the CLS vectors as the records store them, then the fit (espn.live.fitting).

The bulk build (espn_indexing.assemble) feeds it chunks of freshly encoded documents; a
compaction's rewrite (espn.live.rewrite) feeds it the live documents of a snapshot. Both then
add what only they know (the build's metadata and page images, the rewrite's copied groups
and images) and the manifest.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from ..errors import CorpusError
from ..store.format import RECORD_DTYPE, RecordWriter, StoreLayout, stored_cls
from .fitting import CLS_TABLE, Fit, fit_base

__all__ = ["BaseSegmentWriter"]


class BaseSegmentWriter:
    """A base segment written into the directory `out` for `n_docs` documents.

    Records and passages are appended apart, each in doc-number order (the build has both with
    each chunk; the rewrite gathers passages segment by segment after the records):
    `append` or `append_stored` -> embeddings.bin, records.npy and the CLS table;
    `append_passages` -> ids.npy, docs.jsonl and docs_offsets.npy. `finish` checks every
    document arrived, makes it all durable, writes ids_sorted.npy and fits the base.

    layout: how the records are written (`RecordWriter`); id_width: bytes of the widest id;
    source: what a refusal names (the corpus, the index); groups_dir: where the pooling groups
    of records this writer pools go (None: the records are pooled already).
    """

    def __init__(self, out: Path, layout: StoreLayout, n_docs: int, id_width: int, source: str,
                 groups_dir: Path | None = None) -> None:
        self.out, self.layout, self.n_docs, self.source = Path(out), layout, n_docs, source
        self._records = np.lib.format.open_memmap(self.out / "records.npy", mode="w+", dtype=RECORD_DTYPE,
                                                  shape=(n_docs,))
        self._ids = np.lib.format.open_memmap(self.out / "ids.npy", mode="w+", dtype=f"S{max(1, id_width)}",
                                              shape=(n_docs,))
        self._offsets = np.lib.format.open_memmap(self.out / "docs_offsets.npy", mode="w+", dtype=np.int64,
                                                  shape=(n_docs + 1,))
        self._offsets[0] = 0
        # The IVF is fitted on the CLS vectors as a reader of these records decodes them.
        self._cls = np.lib.format.open_memmap(self.out / CLS_TABLE, mode="w+", dtype=np.float16,
                                              shape=(n_docs, layout.d_cls))
        self._records_out = RecordWriter(self.out / "embeddings.bin", layout, groups_dir=groups_dir)
        self._docs = open(self.out / "docs.jsonl", "wb")
        self.n_records = self.n_passages = 0
        self.n_bow = 0

    def append(self, cls: np.ndarray, bow: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """The next documents' records, coded as `layout` stores them: cls [n, d_cls],
        bow [sum(counts), d_bow], counts [n]. Returns their rows of records.npy."""
        return self._rows(self._records_out.append(cls, bow, counts), stored_cls(cls, self.layout))

    def append_stored(self, blob: np.ndarray, lengths: np.ndarray, n_bow: np.ndarray, cls: np.ndarray) -> np.ndarray:
        """The next documents' records copied byte for byte (already stored as `layout` stores
        them; never decoded and coded again): blob, the records one after the other; cls
        [n, d_cls], their CLS vectors as decoded from those bytes. Returns their rows."""
        return self._rows(self._records_out.append_stored(blob, lengths, n_bow), cls)

    def _rows(self, rows: np.ndarray, cls: np.ndarray) -> np.ndarray:
        at = slice(self.n_records, self.n_records + len(rows))
        self._records[at] = rows
        self._cls[at] = cls
        self.n_records = at.stop
        self.n_bow += int(rows["n_bow"].sum())
        return rows

    def append_passages(self, ids: np.ndarray, blob: bytes, lengths: np.ndarray) -> None:
        """The next documents' ids and passages: blob, their docs.jsonl lines one after the
        other; lengths [n], the bytes of each."""
        at = slice(self.n_passages, self.n_passages + len(lengths))
        self._ids[at] = ids
        self._docs.write(blob)
        self._offsets[at.start + 1 : at.stop + 1] = self._offsets[at.start] + np.cumsum(lengths, dtype=np.int64)
        self.n_passages = at.stop

    def finish(self, fit: Fit, pool_factor: int = 1) -> dict[str, Any]:
        """Close and flush every file, write ids_sorted.npy (a duplicate id is refused naming
        both documents) and fit the base (espn.live.fitting.fit_base: the manifest's fitted
        sections are returned). pool_factor: the index's token pooling, for the manifest."""
        if self.n_records != self.n_docs or self.n_passages != self.n_docs:
            raise RuntimeError(f"{self.out}: {self.n_records} records and {self.n_passages} passages written "
                               f"for {self.n_docs} documents")
        self._records_out.close()
        self._docs.flush()
        os.fsync(self._docs.fileno())
        self._docs.close()
        for array in (self._records, self._ids, self._offsets, self._cls):
            array.flush()
        self._write_id_order()
        del self._records, self._ids, self._offsets, self._cls  # fit_base rewrites records.npy, removes the table
        return fit_base(self.out, self.layout, self.n_docs, fit, pool_factor=pool_factor)

    def _write_id_order(self) -> None:
        """ids_sorted.npy, the rows in id order."""
        order = np.argsort(self._ids, kind="stable")
        sorted_ids = self._ids[order]
        dup = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
        if len(dup):
            first = int(dup[0])
            raise CorpusError(
                f"{self.source}: duplicate document id {bytes(sorted_ids[first]).decode()!r} "
                f"(documents #{int(order[first]) + 1} and #{int(order[first + 1]) + 1}); ids must be unique"
            )
        np.save(self.out / "ids_sorted.npy", order)

    def __enter__(self) -> BaseSegmentWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """Left early: the files are closed unfinished (the caller removes `out`)."""
        self._records_out.__exit__(kind, value, traceback)
        if not self._docs.closed:
            self._docs.close()
