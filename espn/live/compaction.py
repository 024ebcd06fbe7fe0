"""Compaction that does not stop the world: tiered merges of deltas, base rewrites from a snapshot.

Two kinds of job (`Plan`), one at a time per index (`live/COMPACT`, an exclusive `flock`):

- *merge*: a run of consecutive small deltas becomes one delta. Doc numbers are kept (a
  document deleted by then stays a hole: no vector in the IVF, no id, no passage), so
  nothing published before or meanwhile needs renumbering, and the tombstones stay valid.
  The records are not copied either: the merged delta's rows point where the sources' did.
- *rewrite*: a new base (a complete index directory, written the way the build writes
  one) from the live documents of every segment, deleted ones dropped, its IVF, centroids
  and residual codes fitted on them (espn.live.fitting). It ranks exactly as a fresh build of
  those documents with this encoder. A *refit* is a rewrite asked for even with nothing to
  merge (`espn refit`).

Both work from a snapshot (the generation current when the job starts, held open so its
files stay) in a staging directory, *without* the writer lock: writes go on and publish
generations meanwhile. Only the swap takes the writer lock (the one moment writes wait):
a merge replaces its run of deltas in the then-current generation; a rewrite carries what
was published meanwhile onto the new base: the records appended since the snapshot are
copied to the end of the new embeddings.bin (one contiguous range, block-aligned at both
ends, so every offset shifts by one constant), the deltas published since become one
delta renumbered after the new base's documents, and the deletions made since are
translated to the new doc numbers. Side indexes (espn.live.side_index.SideIndex) get `on_rewrite` before a rewrite's swap and `on_swap`
there.

`CompactionPolicy` decides when: a merge of the `merge_factor` cheapest consecutive deltas
once there are more than `max_segments`; a rewrite once deltas hold more than
`base_ratio` of the base's documents or more than `max_deleted_fraction` of the doc
numbers are deleted or replaced. Each document is merged O(log n) times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from espn.errors import IndexLockedError, InvalidParameterError
from espn.files.clock import utc_now
from espn.files.crash_points import checkpoint
from espn.files.durable import fsync_path
from espn.files.locks import flock_within
from ..generation.format import Generation
from ..generation.segments import LiveView, open_view

from .merging import merge_segments, side_on_swap
from .progress import COMPACTION_LOCK, PROGRESS_FILE, Progress
from .rewrite import rewrite
from .staging import Staging
from .writer import IndexWriter

__all__ = ["Plan", "CompactionPolicy", "CompactionRunningError", "run_compaction"]

log = logging.getLogger(__name__)


class CompactionRunningError(IndexLockedError):
    """Another compaction of this index is running (one at a time)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """kind "merge": the deltas named `segments` (consecutive) become one; "rewrite": a new base;
    "refit": a new base even when there is nothing to merge or drop."""

    kind: str
    segments: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("merge", "rewrite", "refit"):
            raise InvalidParameterError(f"compaction kind must be merge, rewrite or refit, got {self.kind!r}")


@dataclasses.dataclass(frozen=True)
class CompactionPolicy:
    """When compaction pays, and what it does (see the module's docstring)."""

    max_segments: int = 8
    merge_factor: int = 4
    base_ratio: float = 0.5
    max_deleted_fraction: float = 0.2

    def plan(self, generation: Generation) -> Plan | None:
        g = generation
        if not g.segments and not g.tombstones:
            return None
        if (g.deleted_count > self.max_deleted_fraction * max(1, g.total)
                or g.total - g.base_documents > self.base_ratio * max(1, g.base_documents)):
            return Plan("rewrite")
        if len(g.segments) <= self.max_segments:
            return None
        sizes = [s.documents for s in g.segments]
        width = min(max(2, self.merge_factor), len(sizes))
        start = min(range(len(sizes) - width + 1), key=lambda i: (sum(sizes[i : i + width]), -i))
        return Plan("merge", tuple(s.name for s in g.segments[start : start + width]))

    def due(self, generation: Generation) -> bool:
        return self.plan(generation) is not None


@contextlib.contextmanager
def _compaction_lock(live_dir: Path, wait_s: float) -> Iterator[None]:
    live_dir.mkdir(exist_ok=True)
    fd = os.open(live_dir / COMPACTION_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if not flock_within(fd, wait_s, longest_pause_s=0.05):
            raise CompactionRunningError(f"{live_dir.parent}: another compaction is running")
        yield
    finally:
        os.close(fd)


def run_compaction(writer: IndexWriter, plan: Plan | None, policy: CompactionPolicy | None = None,
                   wait_s: float = 10.0, compaction_wait_s: float = 0.0,
                   swap: Callable[[Callable[[], int]], int] | None = None) -> int | None:
    """Run `plan` (or the one `policy` picks for the current generation) and swap it in;
    returns the generation published, None when there was nothing to do.

    wait_s: how long the swap waits for the writer lock; compaction_wait_s: how long to
    wait for another compaction to finish (CompactionRunningError after it). swap: runs the
    swap (the part under the writer lock) and returns its result; a server hands it to its
    publishing thread (commit.GroupCommit.run_exclusive), which runs at normal priority
    while the compaction itself runs at a lowered one. Default: run it in this thread.
    """
    swap = swap or (lambda run: run())
    with _compaction_lock(writer.live_dir, compaction_wait_s):
        view = open_view(writer.root, verify="none")  # the snapshot: held, so its files stay
        try:
            snapshot = view.generation
            plan = plan if plan is not None else (policy or CompactionPolicy()).plan(snapshot)
            if plan is None or (plan.kind == "rewrite" and not snapshot.segments and not snapshot.tombstones):
                return None
            log.info("compaction: %s of generation %d (%d documents)", plan.kind, snapshot.number,
                     snapshot.live_documents)
            report = Progress(writer.live_dir / PROGRESS_FILE, plan.kind, snapshot.number)
            try:
                with Staging(writer, "compact", wait_s) as staging:
                    if plan.kind == "merge":
                        number = _merge(writer, view, plan, staging.path, wait_s, swap)
                    else:
                        number = rewrite(writer, view, staging.path, wait_s, swap, report)
            finally:
                report.done()
        finally:
            view.close()
    with contextlib.suppress(IndexLockedError):  # the snapshot's files go now, or at the next write
        with writer.locked(0.0):
            writer.collect_garbage()
    return number


# -- merge (its swap; the merged segment is written by espn.live.merging) ------------------

def _merge(writer: IndexWriter, view: LiveView, plan: Plan, staging: Path, wait_s: float,
           swap: Callable[[Callable[[], int]], int]) -> int:
    snapshot = view.generation
    names = [s.name for s in snapshot.segments]
    at = names.index(plan.segments[0]) if plan.segments and plan.segments[0] in names else -1
    if at < 0 or tuple(names[at : at + len(plan.segments)]) != plan.segments:
        raise InvalidParameterError(f"merge: {', '.join(plan.segments)} are not consecutive deltas of generation "
                                    f"{snapshot.number}")
    sources = snapshot.segments[at : at + len(plan.segments)]
    dead = np.flatnonzero(~view.live[sources[0].first : sources[-1].stop]) + sources[0].first \
        if view.live is not None else np.zeros(0, np.int64)
    merged = merge_segments(writer, sources, staging / "seg", dead=dead)
    checkpoint("merge-built")

    def do_swap() -> int:
        with writer.locked(wait_s) as current:
            checkpoint("swap")
            names = [s.name for s in current.segments]
            if tuple(names[at : at + len(sources)]) != plan.segments:  # only compaction removes deltas, one at a time
                raise RuntimeError(f"merge: the deltas {plan.segments} changed while they were merged")
            number = current.number + 1
            name = f"seg-{number:06d}"
            os.replace(staging / "seg", writer.live_dir / name)
            fsync_path(writer.live_dir)
            checkpoint("swap-renamed")
            segments = (*current.segments[:at], dataclasses.replace(merged, name=name),
                        *current.segments[at + len(sources):])
            side = side_on_swap(writer, current, number, lambda numbers: numbers)
            number = writer.commit(Generation(number, current.base, current.base_documents, current.embeddings_bytes,
                                              segments, current.tombstones, utc_now(), current.base_files, side)).number
        log.info("merged %d deltas (%d documents) into %s", len(sources), merged.documents, name)
        return number

    return swap(do_swap)
