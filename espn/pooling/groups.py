"""Which encoder vectors each stored (pooled) BOW vector merged, recorded when records are written.

With token pooling (`store.pool_factor` > 1, `espn.pooling.cluster`) a stored vector is the mean of
several encoder vectors, and an explanation needs to know which ones to show the passage
text it stands for. Recomputing that means re-encoding the passages (a forward pass over
k passages for every explained search); recording it costs two bytes per encoder vector.
Every writer of pooled records writes it beside them (`RecordWriter(groups_dir=...)`, the
build, a delta segment), compaction carries it, and explain reads it.

Two files per index directory or delta segment, only where records are pooled:

    pool_groups.npy          uint16 [sum of encoder vectors]: for each document in turn and
                             each of its encoder vectors in encoder order, the stored row
                             (within the document) it went into
    pool_groups_offsets.npy  int64 [documents + 1]: document i's groups are
                             pool_groups[offsets[i]:offsets[i + 1]]

A document whose groups are not known (its records were written before these files
existed and compaction carried them) has an empty range although its record holds vectors;
explain re-encodes such documents, as it does for an index without the files. The files
are optional: an index without them opens and explains as before.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np

from ..encoders.base import VectorSpans
from ..index import GROUP_OFFSETS_FILE, GROUPS_FILE, POOL_GROUP_FILES  # the files this module writes
from ..mapped import map_npy

__all__ = [
    "GROUPS_FILE",
    "GROUP_OFFSETS_FILE",
    "POOL_GROUP_FILES",
    "GROUP_DTYPE",
    "PoolGroupsWriter",
    "PoolGroups",
    "StoredPoolGroups",
    "open_pool_groups",
    "present_group_files",
    "merge_group_spans",
    "concat_pool_groups",
    "copy_pool_groups",
]

log = logging.getLogger(__name__)

#: A stored row number within one document: pooled documents keep far fewer than 65,536 vectors.
GROUP_DTYPE = np.dtype("<u2")
_MAX_GROUP = int(np.iinfo(GROUP_DTYPE).max)
#: Documents per gather when compaction copies groups.
_BLOCK = 4096


class PoolGroupsWriter:
    """Streams the groups of documents written in order into `directory`'s two files.

    The groups go to a raw scratch file as chunks arrive (nothing corpus-sized in memory
    but the per-document counts, one int64 each); `finish()` writes the .npy files and
    fsyncs them; leaving without `finish()` (an error) removes what was written.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._scratch_path = self.directory / (GROUPS_FILE + ".part")
        self._scratch = open(self._scratch_path, "wb")
        self._counts: list[np.ndarray] = []
        self._total = 0

    def append(self, groups: np.ndarray, source_counts: np.ndarray) -> None:
        """Documents in turn: source_counts [n] encoder vectors each, groups [sum] their rows."""
        counts = np.asarray(source_counts, dtype=np.int64)
        groups = np.asarray(groups)
        if len(groups) != int(counts.sum()):
            raise ValueError(f"{len(groups)} groups do not match {int(counts.sum())} encoder vectors")
        if len(groups) and (int(groups.min()) < 0 or int(groups.max()) > _MAX_GROUP):
            raise ValueError(f"pooled row numbers must lie in 0..{_MAX_GROUP}, got {int(groups.min())}.."
                             f"{int(groups.max())} (a document pooled to more rows than pool_groups.npy holds)")
        self._scratch.write(groups.astype(GROUP_DTYPE).tobytes())
        self._counts.append(counts)
        self._total += len(groups)

    def append_unknown(self, documents: int) -> None:
        """`documents` documents whose groups are not known (an empty range each)."""
        self._counts.append(np.zeros(int(documents), dtype=np.int64))

    def finish(self) -> None:
        """Write pool_groups_offsets.npy and pool_groups.npy (fsynced); the scratch goes."""
        self._scratch.close()
        counts = np.concatenate(self._counts) if self._counts else np.zeros(0, np.int64)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        _write_npy(self.directory / GROUP_OFFSETS_FILE, offsets)
        with open(self.directory / GROUPS_FILE, "wb") as out, open(self._scratch_path, "rb") as raw:
            out.write(_npy_header(GROUP_DTYPE, self._total))
            shutil.copyfileobj(raw, out, 1 << 22)
            out.flush()
            os.fsync(out.fileno())
        self._scratch_path.unlink()

    def abort(self) -> None:
        """Remove whatever was written (the caller failed before `finish`)."""
        self._scratch.close()
        for path in (self._scratch_path, self.directory / GROUPS_FILE, self.directory / GROUP_OFFSETS_FILE):
            path.unlink(missing_ok=True)


def _npy_header(dtype: np.dtype, length: int) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                  "fortran_order": False, "shape": (int(length),)})
    return buffer.getvalue()


def _write_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())


def present_group_files(directory: Path) -> list[str]:
    """The group files `directory` holds (none, or both): what a segment's file list adds."""
    return [name for name in POOL_GROUP_FILES if (Path(directory) / name).is_file()]


class PoolGroups:
    """One directory's groups, memory-mapped: groups [T] uint16, offsets [n + 1] int64."""

    def __init__(self, groups: np.ndarray, offsets: np.ndarray) -> None:
        self.groups, self.offsets = groups, offsets

    @classmethod
    def open(cls, directory: Path, documents: int) -> "PoolGroups | None":
        """The groups of `directory` (holding `documents` documents); None when it has none,
        or, with a warning, when its files do not fit together (explain then re-encodes)."""
        directory = Path(directory)
        if not (directory / GROUPS_FILE).is_file() or not (directory / GROUP_OFFSETS_FILE).is_file():
            return None
        try:
            groups, offsets = map_npy(directory / GROUPS_FILE), map_npy(directory / GROUP_OFFSETS_FILE)
        except (ValueError, OSError) as exc:
            log.warning("%s: unreadable pooling groups (%s); explanations re-encode its passages", directory, exc)
            return None
        problem = _shape_problem(groups, offsets, documents)
        if problem:
            log.warning("%s: %s; explanations re-encode its passages", directory, problem)
            return None
        return cls(groups, offsets)

    def of(self, local: int) -> np.ndarray:
        """Document `local`'s groups (empty: not known)."""
        return self.groups[int(self.offsets[local]): int(self.offsets[local + 1])]


def _shape_problem(groups: np.ndarray, offsets: np.ndarray, documents: int) -> str:
    """Why two arrays are not one directory's groups ('' when they are)."""
    if groups.dtype != GROUP_DTYPE or groups.ndim != 1:
        return f"{GROUPS_FILE} holds {groups.dtype} {groups.shape}, not a 1-d {GROUP_DTYPE} array"
    if offsets.dtype != np.int64 or offsets.shape != (documents + 1,):
        return f"{GROUP_OFFSETS_FILE} holds {offsets.dtype} {offsets.shape}, not int64 ({documents + 1},)"
    if int(offsets[0]) != 0 or int(offsets[-1]) != len(groups) or bool(np.any(np.diff(offsets) < 0)):
        return f"{GROUP_OFFSETS_FILE} does not partition the {len(groups)} groups"
    return ""


class StoredPoolGroups:
    """Groups by global doc number over a base and its delta segments (None parts: no files)."""

    def __init__(self, parts: Sequence[PoolGroups | None], firsts: Sequence[int]) -> None:
        self.parts, self.firsts = list(parts), np.asarray(firsts, dtype=np.int64)

    def of(self, number: int) -> np.ndarray | None:
        """Document `number`'s groups, None when they are not stored."""
        at = int(np.searchsorted(self.firsts, number, side="right")) - 1
        part = self.parts[at] if at >= 0 else None
        if part is None:
            return None
        local = int(number) - int(self.firsts[at])
        return part.of(local) if 0 <= local < len(part.offsets) - 1 else None


def open_pool_groups(base: Path, base_documents: int,
                     segments: Sequence[tuple[Path, int, int]] = ()) -> StoredPoolGroups:
    """The groups of an index: its base directory and each delta as (directory, first doc
    number, documents). Maps a few files per part and holds no descriptor (espn.mapped)."""
    parts = [PoolGroups.open(base, base_documents)]
    firsts = [0]
    for directory, first, documents in segments:
        parts.append(PoolGroups.open(directory, documents))
        firsts.append(first)
    return StoredPoolGroups(parts, firsts)


def merge_group_spans(groups: np.ndarray, source_spans: VectorSpans) -> VectorSpans:
    """Per stored row, the spans of every encoder vector pooled into it, in text order.

    groups [n] (row of each encoder vector), source_spans: n lists of spans.
    """
    rows = int(groups.max()) + 1 if len(groups) else 0
    merged: VectorSpans = [[] for _ in range(rows)]
    for source, group in enumerate(np.asarray(groups).tolist()):
        merged[group].extend(source_spans[source])
    return merged


def _gather(part: PoolGroups, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups of documents `local` (in that order) -> (groups [sum], counts [len(local)])."""
    starts, ends = part.offsets[local], part.offsets[local + 1]
    counts = (ends - starts).astype(np.int64)
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return part.groups[np.repeat(starts, counts) + within], counts


def concat_pool_groups(sources: Sequence[Path], documents: Sequence[int], out: Path) -> list[str]:
    """The groups of consecutive segments (directories holding `documents` documents each)
    as one segment's, written to `out`; returns the file names written (none when no source
    has groups). A source without groups gives its documents empty (unknown) ranges."""
    parts = [PoolGroups.open(directory, n) for directory, n in zip(sources, documents)]
    if all(part is None for part in parts):
        return []
    writer = PoolGroupsWriter(out)
    try:
        for part, n in zip(parts, documents):
            if part is None:
                writer.append_unknown(n)
                continue
            for start in range(0, n, _BLOCK):
                writer.append(*_gather(part, np.arange(start, min(n, start + _BLOCK), dtype=np.int64)))
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return list(POOL_GROUP_FILES)


def copy_pool_groups(stored: StoredPoolGroups, keep: np.ndarray, out: Path) -> list[str]:
    """The groups of doc numbers `keep` (sorted), renumbered 0..len(keep)-1, written to
    `out` (a rewritten base); returns the file names written (none when no part has any)."""
    if all(part is None for part in stored.parts):
        return []
    keep = np.asarray(keep, dtype=np.int64)
    bounds = np.searchsorted(keep, np.append(stored.firsts, np.iinfo(np.int64).max))
    writer = PoolGroupsWriter(out)
    try:
        for at, part in enumerate(stored.parts):
            local = keep[bounds[at]: bounds[at + 1]] - stored.firsts[at]
            if part is None:
                writer.append_unknown(len(local))
                continue
            for start in range(0, len(local), _BLOCK):
                writer.append(*_gather(part, local[start: start + _BLOCK]))
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return list(POOL_GROUP_FILES)
