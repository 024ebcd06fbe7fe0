"""The write service: this worker's writes to the live index, for the routes of /v1/documents.

It holds the group committer (espn.live.commit.GroupCommit over an espn.live LiveIndex),
made at the first write (its encoder loads in its thread), and starts a compaction in a
background thread once the policy asks for one. It owns that thread: `close` (the app's
lifespan, at shutdown) lets a running compaction finish and joins it before the committer
publishes what was accepted and stops, then closes the writer, whose side indexes remove
their work directories (`live/stage-text-*`). Routes get it through `deps.get_writes` and
know nothing of the writer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Callable, Optional, Sequence

from espn.errors import EspnError
from espn.service import (CompactionPolicy, CompactionRunningError, FencedWriter, GroupCommit, LiveIndex,
                          LiveSearcher, MetadataLimits, NewDocument, WriteLimits, WriteResult, lower_priority)

from .settings import ServerSettings

__all__ = ["WriteService", "NewDocument", "WriteResult"]

logger = logging.getLogger(__name__)


class WriteService:
    """Checks, queues and publishes writes (GroupCommit), and compacts past the policy's thresholds."""

    def __init__(self, settings: ServerSettings, live: LiveSearcher, fence: Optional[FencedWriter] = None) -> None:
        self.settings = settings
        self.fence = fence  # --publish: every generation goes to the store before it is acknowledged
        self.limits = WriteLimits(MetadataLimits(settings.max_metadata_fields, settings.max_metadata_bytes,
                                                 settings.max_index_fields))
        self.policy = CompactionPolicy(settings.compact_max_segments, settings.compact_merge_factor,
                                       settings.compact_base_ratio, settings.compact_deleted_fraction)

        def serve_it(generation: int) -> None:  # this worker searches the new generation before it answers
            live.refresh()

        self.committer = GroupCommit(LiveIndex(settings.index, limits=self.limits, fence=fence),
                                     wait_s=settings.write_wait_s,
                                     nice=settings.write_nice, max_queued=settings.write_queue, on_publish=serve_it)
        self._lock = threading.Lock()  # guards the compaction thread and `_closed`
        self._compaction: threading.Thread | None = None
        self._closed = False

    def warmup(self) -> None:
        """Load what the first write would (the document encoder: a second of CPU, more on a busy
        machine) and encode one passage, nothing published, so that the first write is as fast
        as the next. Also removes what a stopped server left in live/ (a staging directory
        whose owner is gone), when no other writer holds the lock at this moment (else that
        writer's own recovery does it)."""
        self.committer.index.warmup()  # a passage, or a blank page for an index of pages
        self.committer.index.recover()  # never written to: left as it was

    def submit(self, upserts: Sequence[NewDocument], deletes: Sequence[str]) -> "concurrent.futures.Future[WriteResult]":
        """Queue one write; a bad one is refused here (InvalidParameterError), before it is queued."""
        return self.committer.submit(upserts, deletes)

    async def apply(self, upserts: Sequence[NewDocument], deletes: Sequence[str]) -> WriteResult:
        """One write, answered once the generation holding it is durable and this worker serves it."""
        result = await asyncio.wrap_future(self.submit(upserts, deletes))
        self.maybe_compact()
        return result

    def maybe_compact(self) -> None:
        """Past the policy's thresholds, compact in a background thread of this worker: a merge of
        small deltas or a base rewrite, from a snapshot. Searches and writes go on; writes wait
        only for the swap. One compaction per index at a time: when another worker's is running,
        this one is one log line."""
        with self._lock:
            if self._closed or (self._compaction is not None and self._compaction.is_alive()):
                return
            if not self.policy.due(self.committer.index.current()):
                return
            # Not a daemon: `close` joins it, so that the process never ends in the middle of a compaction.
            self._compaction = threading.Thread(target=self._compact, name="espn-compact")
            self._compaction.start()

    def _swap(self, run: Callable[[], int]) -> int:
        """The swap holds the writer lock: it runs on the publishing thread, at normal priority."""
        return self.committer.run_exclusive(run).result()

    def _compact(self) -> None:
        lower_priority(self.settings.write_nice)  # the work before the swap takes what searches leave
        compactor = LiveIndex(self.settings.index, limits=self.limits, fence=self.fence)
        try:
            compactor.maintain(self.policy, wait_s=self.settings.write_wait_s, swap=self._swap)
        except CompactionRunningError:
            logger.info("compaction not started: another one is running on this index")
        except (EspnError, OSError) as exc:  # the disk is full, the writer lock stayed busy: try after a later write
            logger.warning("compaction did not run: %s", exc)
        except Exception:  # a bug: its traceback is worth having
            logger.exception("compaction failed")
        finally:
            compactor.close()  # its side indexes' writers (a text engine's) go with it

    def close(self) -> None:
        """Let a running compaction finish (its swap runs on the committer's thread) and join it,
        publish what was accepted and stop the committer's threads, then close the writer (its
        side indexes remove their work directories). Idempotent."""
        with self._lock:
            self._closed = True  # no compaction starts from now on
            compaction = self._compaction
        if compaction is not None and compaction.is_alive():
            logger.info("waiting for the running compaction to finish")
            compaction.join()
        self.committer.close()
        self.committer.index.close()
