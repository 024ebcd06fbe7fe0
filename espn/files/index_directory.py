"""What a directory of indexes is asked without opening an index: whether a directory holds
one, and how much memory it would keep once searched, from file names and sizes alone.

Here, not in espn.index, so that settings and the server's memory budget can ask without numpy.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["is_index_directory", "resident_bytes"]


def is_index_directory(path: Path | str) -> bool:
    """Whether `path` holds an index (its manifest, espn.index.MANIFEST): what a directory of
    indexes is scanned for."""
    return (Path(path) / "manifest.json").is_file()


#: Files an open index reads from storage per query or per hit (not held in memory), and the
#: directory of the model, loaded once per process and shared between indexes.
_READ_PER_QUERY = frozenset({"embeddings.bin", "docs.jsonl"})
_SHARED_DIRS = frozenset({"encoder"})


def resident_bytes(index: Path | str, mapped_embeddings: bool = False) -> int:
    """An upper bound of what the index at `index` keeps in memory once searched: the size of every
    file its searches map (IVF, record table, ids, metadata, pooling groups, first stage, full-text
    index; each base and delta) but the records, read from storage per query unless
    `mapped_embeddings` (the mmap reader maps them), the passages, read per hit, and the model."""
    total = 0
    for top, dirs, files in os.walk(index):
        dirs[:] = [d for d in dirs if d not in _SHARED_DIRS]  # the base's, and each rewritten base's
        for name in files:
            if name in _READ_PER_QUERY and not (mapped_embeddings and name == "embeddings.bin"):
                continue
            try:
                total += os.stat(os.path.join(top, name), follow_symlinks=False).st_size
            except OSError:  # removed meanwhile (a compaction's old segment)
                continue
    return total
