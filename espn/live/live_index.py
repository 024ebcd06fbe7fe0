"""`LiveIndex`: the writer of a live index with what the index itself brings wired in: its own
side indexes (the full-text index, when its base has one) and compaction.

The writer (espn.live.writer) is given its side indexes and knows nothing of compaction;
compaction (espn.live.compaction) takes a writer. This class is where the two meet, so the
arrows between them point one way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from espn.encoders import Encoder

from .checks import WriteLimits, WriteResult
from .compaction import CompactionPolicy, Plan, run_compaction
from .side_index import SideIndex
from .text_side import own_side_indexes
from .writer import IndexWriter, WriteFence

__all__ = ["LiveIndex"]


class LiveIndex(IndexWriter):
    """An IndexWriter whose side indexes default to the index's own, with compaction.

    `LiveIndex(root)` takes the writer lock for each publish; `LiveIndex.open(root)` holds it
    until `close()` (see IndexWriter).
    """

    def __init__(self, root: Path | str, encoder: Encoder | None = None, limits: WriteLimits = WriteLimits(),
                 side_indexes: Sequence[SideIndex] | None = None, fence: WriteFence | None = None) -> None:
        root = Path(root).absolute()
        super().__init__(root, encoder, limits, own_side_indexes(root) if side_indexes is None else side_indexes,
                         fence)

    def compact(self, wait_s: float = 0.0) -> WriteResult:
        """Rewrite the base from every segment's live documents (deleted ones dropped), from a
        snapshot: writes go on meanwhile and are carried over at the swap, which waits up to
        `wait_s` for the writer lock (as does the wait for another compaction)."""
        number = run_compaction(self, Plan("rewrite"), wait_s=wait_s, compaction_wait_s=wait_s)
        return WriteResult(self.current().number if number is None else number)

    def refit(self, wait_s: float = 0.0, swap: Callable[[Callable[[], int]], int] | None = None) -> WriteResult:
        """Rewrite the base now, fitting its IVF, centroids and residual codes on the index's live
        documents (espn.live.fitting), from a snapshot as `compact` does; writes go on meanwhile."""
        number = run_compaction(self, Plan("refit"), wait_s=wait_s, compaction_wait_s=wait_s, swap=swap)
        return WriteResult(self.current().number if number is None else number)

    def maintain(self, policy: CompactionPolicy | None = None, wait_s: float = 10.0,
                 swap: Callable[[Callable[[], int]], int] | None = None) -> int | None:
        """Run the compaction `policy` asks for now, if any; the generation it published, or
        None. CompactionRunningError when another one runs. swap: what runs its swap
        (see run_compaction)."""
        return run_compaction(self, None, policy, wait_s=wait_s, swap=swap)

