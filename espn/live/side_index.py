"""The protocol of an index kept beside the vectors (the full-text index, any future one).

The writer is given its side indexes (it never builds one) and calls them at fixed points;
compaction does the same at its swap. espn.live.text_side is the one implementation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from .encoding import EncodedDocuments

__all__ = ["SideIndex", "SwapSource"]


class SwapSource:
    """What a base rewrite's swap hands the side indexes: the new base directory (with its own
    side files, see `SideIndex.on_rewrite`), the carried-over segments ({first doc number:
    segment directory}) and the doc numbers deleted since the snapshot, in the new numbering."""

    def __init__(self, base: Path, carried: Mapping[int, Path], deleted: np.ndarray) -> None:
        self.base, self.carried, self.deleted = Path(base), dict(carried), np.asarray(deleted, dtype=np.int64)


class SideIndex(Protocol):
    """An index kept beside the vectors that moves with every generation (a full-text index).

    The writer calls it at fixed points, under the writer lock, before the generation
    record is written; whatever it returns is that generation's `side[name]` entry, whose
    `files` ({path under live/: {"bytes", "sha256"}}) the generation then names (kept by the
    garbage collector while a held generation names them; numbered names like
    `text-000012/` are removed when unpublished after a crash). Deleted or replaced doc
    numbers must never match again; doc numbers are those of espn.generation.segments.
    """

    name: str

    def on_write(self, live_dir: Path, number: int, previous: Mapping[str, Any] | None, first: int,
                 documents: EncodedDocuments | None, tombstones: np.ndarray) -> Mapping[str, Any]:
        """Generation `number` adds `documents` at doc numbers first.. and deletes `tombstones`."""

    def on_rewrite(self, base: Path) -> None:
        """A compaction wrote a new base at `base` (before its swap, without the writer lock):
        build this side's own index of it there, recorded in its manifest."""

    def on_swap(self, live_dir: Path, number: int, previous: Mapping[str, Any] | None,
                renumber: Callable[[np.ndarray], np.ndarray], source: SwapSource | None = None) -> Mapping[str, Any]:
        """A compaction swaps in generation `number`: doc numbers of the generation before map
        through `renumber` (-1: dropped); the identity for a merge of deltas (source None). A base
        rewrite also gives its SwapSource: the new base, the carried segments, the deletes."""

    def close(self) -> None:
        """Release what it holds between writes (the writer closes)."""
