"""The single writer of a live index's text side: applies adds and deletes in a private
work directory and publishes each generation as a new directory of hard links (the module
doc of `espn.text.engine` says why generations are never changed)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import tantivy

from ..errors import IndexCorruptError, storage_full
from ..files.checksums import sha256_file
from ..files.durable import fsync_path
from .config import TextConfig
from .schema import FIELD_DOC, SEGMENT_FILE, TextDocument, engine_files, open_index, to_document

__all__ = ["TextWriter", "restore_work", "tantivy_io_error"]


def tantivy_io_error(exc: ValueError, what: str, directory: Path, room_bytes: int) -> Exception:
    """A Tantivy error as the library's: a full disk is a StorageFullError, another I/O failure
    an OSError (the writer answers both as a failed write), anything else stays what it was.

    A failure in Tantivy's indexing thread reaches Python only as "An index writer was killed
    ... (io::Error most likely)", without its cause: it counts as a full disk when the
    filesystem has less free than `room_bytes` (what the writer flushes at once) or 1% of it."""
    full = storage_full(exc, what)
    if full is not None:
        return full
    message = str(exc)
    if "IO error" not in message and "io::Error" not in message:
        return exc
    stat = os.statvfs(directory)
    if stat.f_bavail * stat.f_frsize < max(room_bytes, stat.f_blocks * stat.f_frsize // 100):
        return storage_full(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory)), what) or exc
    return OSError(errno.EIO, f"{what}: {exc}")


class TextWriter:
    """The single writer of a live index's text side.

    `work` is private to the writer; `published` is the directory of the last published
    generation (the base's `text/` at first). Opening rebuilds `work` from `published` by
    hard links, so what a crashed writer committed but never published is gone.
    """

    def __init__(self, work: Path, published: Path, config: TextConfig, heap_bytes: int = 64 << 20,
                 restore: bool = True) -> None:
        """restore=False: `work` is known to hold exactly `published` already (this writer's own
        last publish), so it is reopened as it is."""
        self.work, self.config = Path(work), config
        if restore or not (self.work / "meta.json").is_file():
            restore_work(self.work, Path(published))
        self._index = open_index(self.work, config)
        self._writer = self._index.writer(heap_size=heap_bytes, num_threads=1)
        self._heap_bytes = heap_bytes

    def apply(self, adds: Sequence[TextDocument], deletes: Sequence[int] | np.ndarray) -> None:
        """Delete the doc numbers `deletes`, add `adds`, and commit (not yet published)."""
        numbers = [int(n) for n in np.asarray(deletes, dtype=np.int64).tolist()]
        try:
            if numbers:
                self._writer.delete_documents_by_query(
                    tantivy.Query.term_set_query(self._index.schema, FIELD_DOC, numbers))
            for doc in adds:
                self._writer.add_document(to_document(doc))
            self._writer.commit()
        except ValueError as exc:  # Tantivy reports I/O failures as ValueError("An IO error occurred: ...")
            raise self._io_error(exc) from exc

    def _io_error(self, exc: ValueError) -> Exception:
        return tantivy_io_error(exc, f"the full-text index in {self.work}", self.work, 2 * self._heap_bytes)

    def publish(self, dest: Path, previous: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """Hard-link the committed state into the new directory `dest` (created whole by a
        rename, fsynced) and return its file entries {name: {bytes, sha256}}. Files already in
        `previous` (the last generation's entries) keep their sha256: segment files never change.
        """
        dest = Path(dest)
        staging = dest.with_name(dest.name + ".partial")
        for _ in range(100):  # a background merge may retire files between listing and linking
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
            raw = (self.work / "meta.json").read_bytes()
            try:
                names = engine_files(self.work, json.loads(raw))
                for name in names[1:]:
                    os.link(self.work / name, staging / name)
            except FileNotFoundError:
                continue
            with open(staging / "meta.json", "wb") as f:  # the very meta.json the files were listed from
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            break
        else:
            raise IndexCorruptError(f"{self.work}: could not take a consistent copy of the text index")
        entries = {}
        for name in names:
            size = (staging / name).stat().st_size
            known = (previous or {}).get(name)
            if known is not None and known["bytes"] == size and name != "meta.json":
                entries[name] = {"bytes": size, "sha256": known["sha256"]}
            else:
                entries[name] = {"bytes": size, "sha256": sha256_file(staging / name)}
        fsync_path(staging)
        os.replace(staging, dest)
        fsync_path(dest.parent)
        self.collect_garbage()
        return entries

    def collect_garbage(self) -> None:
        """Remove from the work directory the segment files no commit names any more and the
        engine does not manage (the ones restored from a published generation)."""
        managed_path = self.work / ".managed.json"
        managed = set(json.loads(managed_path.read_text())) if managed_path.is_file() else set()
        try:
            live = set(engine_files(self.work))
        except FileNotFoundError:
            return
        for name in os.listdir(self.work):
            if SEGMENT_FILE.match(name) and name not in live and name not in managed:
                (self.work / name).unlink(missing_ok=True)

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer, self._index = self._writer, None, None
            try:
                writer.wait_merging_threads()
            except ValueError as exc:  # a merge that failed, or the writer killed by a failed write
                raise self._io_error(exc) from exc

    def __enter__(self) -> "TextWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def restore_work(work: Path, published: Path) -> None:
    """Make `work` exactly the published generation's files (hard links; no engine bookkeeping)."""
    if work.exists():
        shutil.rmtree(work)
    staging = work.with_name(work.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    for name in engine_files(published):
        os.link(published / name, staging / name)
    os.replace(staging, work)
    fsync_path(work.parent)
