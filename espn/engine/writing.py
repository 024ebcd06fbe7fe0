"""Writes of one served index: the group committer and the background compaction.

It holds the group committer (espn.live.commit.GroupCommit over an espn.live LiveIndex),
made at the first write or at warm-up (its encoder loads in its thread), and starts a
compaction in a background thread once the policy asks for one. It owns that thread:
`close` lets a running compaction finish and joins it before the committer publishes what
was accepted and stops, then closes the writer, whose side indexes remove their work
directories (`live/stage-text-*`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..errors import EspnError
from ..live.checks import NewDocument, WriteLimits, WriteResult
from ..live.commit import GroupCommit, lower_priority
from ..live.compaction import CompactionPolicy, CompactionRunningError
from ..live.live_index import LiveIndex
from ..live.writer import WriteFence
from ..metadata import MetadataLimits
from .config import IndexConfig

__all__ = ["Writing"]

logger = logging.getLogger(__name__)


class Writing:
    """Checks, queues and publishes writes (GroupCommit), and compacts past the policy's thresholds.

    on_publish(generation): called on the publishing thread once a generation is durable, before
    its writers are answered (the search side swaps to it there); on_compacted(kind, seconds):
    once a compaction of this process has been swapped in. fence: a publishing writer's
    (espn.live.replication.fenced.FencedWriter): every generation, a compaction's too, goes to
    the store before it is committed and acknowledged, and only while this process leads."""

    def __init__(self, index: Path, config: IndexConfig, on_publish: Callable[[int], None],
                 on_compacted: Callable[[str, float], None] = lambda kind, seconds: None,
                 fence: Optional[WriteFence] = None) -> None:
        self.index = index
        self.config = config
        self.fence = fence
        self.limits = WriteLimits(MetadataLimits(config.max_metadata_fields, config.max_metadata_bytes,
                                                 config.max_index_fields))
        self.policy = CompactionPolicy(config.compact_max_segments, config.compact_merge_factor,
                                       config.compact_base_ratio, config.compact_deleted_fraction)
        self.committer = GroupCommit(LiveIndex(index, limits=self.limits, fence=fence), wait_s=config.write_wait_s,
                                     nice=config.write_nice, max_queued=config.write_queue, on_publish=on_publish)
        self._lock = threading.Lock()  # guards the compaction thread, `_running` and `_closed`
        self._compaction: threading.Thread | None = None
        self._running = False  # the thread is compacting (it may chain one job after another)
        self._on_compacted = on_compacted  # (merge or rewrite, seconds): a rewrite fits the index again
        self._closed = False

    def warmup(self) -> None:
        """Load what the first write would (the document encoder: a second of CPU, more on a busy
        machine) and encode one passage, nothing published, so that the first write is as fast
        as the next. Also removes what a stopped server left in live/ (a staging directory
        whose owner is gone), when no other writer holds the lock at this moment."""
        self.committer.index.warmup()  # a passage, or a blank page for an index of pages
        self.committer.index.recover()  # never written to: left as it was

    def submit(self, upserts: Sequence[NewDocument], deletes: Sequence[str]) -> "concurrent.futures.Future[WriteResult]":
        """Queue one write; a bad one is refused here (InvalidParameterError), before it is queued."""
        return self.committer.submit(upserts, deletes)

    async def apply(self, upserts: Sequence[NewDocument], deletes: Sequence[str]) -> WriteResult:
        """One write, answered once the generation holding it is durable and this process serves it."""
        result = await asyncio.wrap_future(self.submit(upserts, deletes))
        self.maybe_compact()
        return result

    def maybe_compact(self) -> None:
        """Past the policy's thresholds, compact in a background thread: a merge of small deltas or
        a base rewrite (which fits the index on its documents again), from a snapshot. Searches and
        writes go on; writes wait only for the swap. One compaction per index at a time: when
        another process's is running, this is one log line."""
        plan = self.policy.plan(self.committer.index.current())
        if plan is not None:
            self._start(plan.kind)

    def refit(self) -> bool:
        """Start a re-fit in the background now (a base rewrite, espn.live.fitting); False when a
        compaction of this process already runs."""
        return self._start("refit")

    def _start(self, kind: str) -> bool:
        with self._lock:
            if self._closed or self._running:
                return False
            self._running = True
            # Not a daemon: `close` joins it, so that the process never ends in the middle of a compaction.
            self._compaction = threading.Thread(target=self._compact, args=(kind,), name=f"espn-{kind}")
            self._compaction.start()
            return True

    def _swap(self, run: Callable[[], int]) -> int:
        """The swap holds the writer lock: it runs on the publishing thread, at normal priority."""
        return self.committer.run_exclusive(run).result()

    def wait_idle(self) -> None:
        """Until no compaction of this process runs, those it chains included (tests, benchmarks)."""
        while True:
            with self._lock:
                thread = self._compaction if self._running else None
            if thread is None:
                return
            thread.join()

    def _compact(self, kind: str) -> None:
        """One compaction, then the next while the policy asks for one: writes published while a
        rewrite ran (carried onto the new base as one delta) can make it due again at once, and an
        index whose writes have stopped would otherwise keep that delta, fitted on the documents it
        had before, until the next write."""
        lower_priority(self.config.write_nice)  # the work before the swap takes what searches leave
        try:
            while self._compact_once(kind):
                with self._lock:
                    plan = None if self._closed else self.policy.plan(self.committer.index.current())
                    if plan is None:
                        self._running = False  # under the lock: a write's maybe_compact from now on starts one
                        return
                kind = plan.kind
        finally:
            with self._lock:
                self._running = False

    def _compact_once(self, kind: str) -> bool:
        """One compaction job (a re-fit, or what the policy plans); False when none ran to its swap."""
        compactor = LiveIndex(self.index, limits=self.limits, fence=self.fence)
        started = time.perf_counter()
        try:
            if kind == "refit":
                compactor.refit(wait_s=self.config.write_wait_s, swap=self._swap)
            else:
                compactor.maintain(self.policy, wait_s=self.config.write_wait_s, swap=self._swap)
            self._on_compacted("merge" if kind == "merge" else "rewrite", time.perf_counter() - started)
            return True
        except CompactionRunningError:
            logger.info("compaction not started: another one is running on this index")
        except (EspnError, OSError) as exc:  # the disk is full, the writer lock stayed busy: try after a later write
            logger.warning("compaction did not run: %s", exc)
        except Exception:  # a bug: its traceback is worth having
            logger.exception("compaction failed")
        finally:
            compactor.close()  # its side indexes' writers (a text engine's) go with it
        return False

    def close(self) -> None:
        """Let a running compaction finish and join it, publish what was accepted and stop the
        committer's threads, then close the writer. Idempotent."""
        with self._lock:
            self._closed = True  # no compaction starts from now on
            compaction = self._compaction
        if compaction is not None and compaction.is_alive():
            logger.info("waiting for the running compaction to finish")
            compaction.join()
        self.committer.close()
        self.committer.index.close()
