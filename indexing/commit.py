"""Group commit: the writes that arrive while a generation is being published are encoded
together and published as the next one.

`GroupCommit.submit` checks a write (ids, text, metadata: a bad write fails at once and
never enters the queue) and queues it; one committer thread takes everything queued,
encodes all its documents in one batched call (in memory, at a lowered CPU priority so
that searches keep the cores they need), then publishes the group through
`LiveIndex.publish` (which takes the writer lock for the publish only) and, before any
caller is answered, runs `on_publish` (a server swaps its Searcher to the new
generation there). A caller's future resolves once the generation holding its write is
durable and visible.

Across processes (the workers of `espn serve --workers N`, an `espn add`) each process
has its own committer and they take turns on the index's writer lock: a worker's
committer publishes everything queued in that worker; while it holds the lock the other
workers' committers keep encoding their own groups, so the lock is held only for the I/O
of a publish and no request has to travel between processes. The alternative, one
writer process the others forward to, would group across workers too but needs a
second copy of the encoder, an IPC protocol and a failure mode of its own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
from typing import Callable, Sequence

from espn.errors import EspnError, WriteFailedError

from . import live
from .encode import EncodedDocuments
from .live import LiveIndex, NewDocument, WriteRequest, WriteResult, check_write

__all__ = ["GroupCommit", "lower_priority"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Queued:
    request: WriteRequest
    upserts: Sequence[NewDocument]
    future: "concurrent.futures.Future[WriteResult]"


class GroupCommit:
    """Queues writes from any thread; one thread encodes and publishes them in groups.

    wait_s: how long a group waits for the writer lock before its writes fail with
    IndexLockedError. nice: the committer thread's CPU priority (0..19, Linux), so
    encoding takes what searches leave. max_queued: documents (and deletes) waiting before
    `submit` refuses with WriteFailedError. on_publish(generation) runs after each
    publish, before the writes of the group are answered.
    """

    def __init__(self, index: LiveIndex, *, wait_s: float = 10.0, nice: int = 10, max_queued: int = 10_000,
                 batch_size: int = 32, on_publish: Callable[[int], None] | None = None) -> None:
        self.index = index
        self.wait_s, self.nice, self.max_queued, self.batch_size = wait_s, nice, max_queued, batch_size
        self.on_publish = on_publish
        self._queue: list[_Queued] = []
        self._queued_items = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        #: Groups published and writes in them (for tests and metrics).
        self.groups = self.writes = 0

    def submit(self, upserts: Sequence[NewDocument] = (), deletes: Sequence[str] = ()) -> "concurrent.futures.Future[WriteResult]":
        """Queue one write (all or nothing); InvalidParameterError at once for a bad one."""
        request = check_write(upserts, deletes, self.index.limits)
        future: concurrent.futures.Future[WriteResult] = concurrent.futures.Future()
        items = len(request.upserts) + len(request.deletes)
        with self._cond:
            if self._closed:
                raise WriteFailedError("the writer is shutting down; retry")
            if self._queued_items and self._queued_items + items > self.max_queued:
                raise WriteFailedError(f"{self._queued_items} writes are queued already (at most {self.max_queued}); "
                                       "retry")
            self._queue.append(_Queued(request, list(upserts), future))
            self._queued_items += items
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="espn-commit", daemon=True)
                self._thread.start()
            self._cond.notify()
        return future

    def close(self) -> None:
        """Publish what is queued, then stop the committer."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        lower_priority(self.nice)
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                group, self._queue, self._queued_items = self._queue, [], 0
            self._commit(group)

    def _commit(self, group: list[_Queued]) -> None:
        live._checkpoint("queued")
        try:
            encoded = self._encode(group)
            live._checkpoint("encoded")
            outcomes = self.index.publish([q.request for q in group], encoded, self.wait_s)
        except (EspnError, OSError) as exc:
            error = exc if isinstance(exc, EspnError) else WriteFailedError(
                f"the write failed: {exc.strerror or exc}; nothing of it was published")
            for q in group:
                q.future.set_exception(error)
            return
        except BaseException as exc:  # a bug: every caller hears of it, the committer goes on
            log.exception("publishing %d writes failed", len(group))
            for q in group:
                q.future.set_exception(exc)
            return
        published = max((o.generation for o in outcomes if isinstance(o, WriteResult)), default=None)
        if published is not None and self.on_publish is not None:
            try:
                self.on_publish(published)
            except Exception:  # noqa: BLE001 - the write is durable; readers find it at their next look
                log.exception("could not open generation %d after publishing it", published)
        self.groups += 1
        self.writes += len(group)
        for q, outcome in zip(group, outcomes):
            if isinstance(outcome, Exception):
                q.future.set_exception(outcome)
            else:
                q.future.set_result(outcome)

    def _encode(self, group: list[_Queued]) -> list[EncodedDocuments | None]:
        """One batched encode for every document of the group, split back per write."""
        everything = self.index.encode([d for q in group for d in q.upserts], self.batch_size)
        out: list[EncodedDocuments | None] = []
        at = 0
        for q in group:
            if everything is None or not q.upserts:
                out.append(None)
                continue
            out.append(everything.take(range(at, at + len(q.upserts))))
            at += len(q.upserts)
        return out


def lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority (Linux: a thread is a task; threads it starts,
    such as torch's OpenMP team, inherit it)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        log.debug("could not lower the committer's priority: %s", exc)
