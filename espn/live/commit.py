"""Group commit: the writes that arrive while a generation is being published are encoded
together and published as the next one.

`GroupCommit.submit` checks a write (ids, text, metadata: a bad write fails at once and
never enters the queue) and queues it. Two threads then carry the queue:

- the *encoder* takes everything queued and encodes all its documents in one batched call,
  in memory, at a lowered CPU priority (`nice`), so searches keep the cores they need and
  encoding takes what they leave;
- the *publisher* publishes each encoded group through `IndexWriter.publish` (which takes
  the writer lock for the publish only), runs `on_publish` (a server swaps its Searcher to
  the new generation there), then answers every write of the group. It runs at normal
  priority: it holds the writer lock, and a starved lock holder would hold up every
  writer (priority inversion). A compaction's swap runs here too (`run_exclusive`).

While one group is published the next is encoded, so the lock is held only for the I/O
of a publish. A caller's future resolves once the generation holding its write is durable
and visible.

Across processes (the workers of `espn serve --workers N`, an `espn add`) each process has
its own GroupCommit and they take turns on the index's writer lock: a worker publishes
what was queued in that worker, while the other workers keep encoding their own groups,
and no request has to travel between processes. The alternative, one writer process the
others forward to, would group across workers too, but needs a second copy of the
encoder, an IPC protocol and a failure mode of its own.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
from typing import Any, Callable, Sequence, TypeVar

from espn.errors import EspnError, InvalidParameterError, WriteFailedError, storage_full
from espn.files.crash_points import checkpoint

from .checks import NewDocument, WriteRequest, WriteResult
from .encoding import EncodedDocuments
from .writer import IndexWriter

__all__ = ["GroupCommit", "lower_priority"]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass
class _Queued:
    request: WriteRequest
    upserts: Sequence[NewDocument]
    future: "concurrent.futures.Future[WriteResult]"


@dataclasses.dataclass
class _Encoded:
    group: list[_Queued]
    encoded: list[EncodedDocuments | None]


@dataclasses.dataclass
class _Task:
    run: Callable[[], Any]
    future: "concurrent.futures.Future[Any]"


class GroupCommit:
    """Queues writes from any thread; they are encoded and published in groups.

    wait_s: how long a group waits for the writer lock before its writes fail with
    IndexLockedError. nice: the encoder thread's CPU priority (0..19, Linux).
    max_queued: documents (and deletes) waiting before `submit` refuses with
    WriteFailedError. on_publish(generation) runs after each publish, before the writes of
    the group are answered.
    """

    def __init__(self, index: IndexWriter, *, wait_s: float = 10.0, nice: int = 10, max_queued: int = 10_000,
                 batch_size: int = 32, on_publish: Callable[[int], None] | None = None) -> None:
        self.index = index
        self.wait_s, self.nice, self.max_queued, self.batch_size = wait_s, nice, max_queued, batch_size
        self.on_publish = on_publish
        self._queue: list[_Queued] = []  # checked, waiting to be encoded
        self._queued_items = 0
        self._ready: collections.deque[_Encoded | _Task] = collections.deque()  # waiting to be published
        self._encoding = False
        self._cond = threading.Condition()
        self._closed = False
        self._threads: list[threading.Thread] = []
        #: Groups published and writes in them (for tests and metrics).
        self.groups = self.writes = 0

    def submit(self, upserts: Sequence[NewDocument] = (), deletes: Sequence[str] = ()) -> "concurrent.futures.Future[WriteResult]":
        """Queue one write (all or nothing); InvalidParameterError at once for a bad one."""
        request = self.index.check(upserts, deletes)
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
            self._start()
            self._cond.notify_all()
        return future

    def run_exclusive(self, run: Callable[[], T]) -> "concurrent.futures.Future[T]":
        """Run `run` on the publishing thread, between two publishes (at its priority)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise WriteFailedError("the writer is shutting down")
            self._ready.append(_Task(run, future))
            self._start()
            self._cond.notify_all()
        return future

    def close(self) -> None:
        """Publish what is queued, then stop both threads."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = list(self._threads)
        for thread in threads:
            thread.join()

    def _start(self) -> None:
        if not self._threads:
            self._threads = [threading.Thread(target=self._encode_loop, name="espn-encode", daemon=True),
                             threading.Thread(target=self._publish_loop, name="espn-publish", daemon=True)]
            for thread in self._threads:
                thread.start()

    # -- the encoder ---------------------------------------------------------------------
    def _encode_loop(self) -> None:
        lower_priority(self.nice)
        while True:
            with self._cond:
                # One encoded group may wait for the publisher: encoding runs one group ahead.
                while not self._closed and (not self._queue or any(isinstance(r, _Encoded) for r in self._ready)):
                    self._cond.wait()
                if not self._queue:
                    return
                group, self._queue, self._queued_items = self._queue, [], 0
                self._encoding = True
            checkpoint("queued")
            try:
                encoded = self._encode(group)
                checkpoint("encoded")
            except InvalidParameterError as exc:  # an input the encoder refuses (a page that does not
                # decode): each write alone, so that only the one holding it fails
                if len(group) == 1:
                    self._fail(group, exc)
                    encoded = None
                else:
                    group, encoded = self._encode_each(group)
            except BaseException as exc:
                self._fail(group, exc)
                encoded = None
            with self._cond:
                if encoded is not None:
                    self._ready.append(_Encoded(group, encoded))
                self._encoding = False
                self._cond.notify_all()

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

    def _encode_each(self, group: list[_Queued]) -> tuple[list[_Queued], list[EncodedDocuments | None] | None]:
        """The writes of a group encoded one at a time; a write the encoder refuses fails alone.
        -> (the writes left, their encodings), or (_, None) when none is left."""
        kept: list[_Queued] = []
        encoded: list[EncodedDocuments | None] = []
        for q in group:
            try:
                encoded += self._encode([q])
                kept.append(q)
            except BaseException as exc:
                self._fail([q], exc)
        return kept, (encoded if kept else None)

    # -- the publisher -------------------------------------------------------------------
    def _publish_loop(self) -> None:
        while True:
            with self._cond:
                while not self._ready and not (self._closed and not self._queue and not self._encoding):
                    self._cond.wait()
                if not self._ready:
                    return
                item = self._ready.popleft()
                self._cond.notify_all()
            if isinstance(item, _Task):
                try:
                    item.future.set_result(item.run())
                except BaseException as exc:  # noqa: BLE001 - the caller of run_exclusive gets it
                    item.future.set_exception(exc)
            else:
                self._publish(item.group, item.encoded)

    def _publish(self, group: list[_Queued], encoded: list[EncodedDocuments | None]) -> None:
        try:
            outcomes = self.index.publish([q.request for q in group], encoded, self.wait_s)
        except BaseException as exc:
            self._fail(group, exc)
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

    @staticmethod
    def _fail(group: list[_Queued], exc: BaseException) -> None:
        """Every write of the group hears of the failure; nothing of it was published."""
        full = storage_full(exc, f"{len(group)} write(s)")
        if full is not None:  # a 507: nothing of it published; the next write's recovery removes its leftovers
            log.warning("%s", full)
            exc = full
        elif isinstance(exc, OSError):
            log.warning("writing %d writes failed: %s", len(group), exc, exc_info=exc)
            exc = WriteFailedError(f"the write failed: {exc.strerror or exc}; nothing of it was published")
        elif not isinstance(exc, EspnError):  # a bug: logged with its traceback, the committer goes on
            log.error("writing %d writes failed", len(group), exc_info=exc)
        for q in group:
            q.future.set_exception(exc)


def lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority (Linux: a thread is a task; threads it starts,
    such as torch's OpenMP team, inherit it). It cannot be raised again without privileges,
    so only threads that never hold the writer lock call this."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        log.debug("could not lower the encoder's priority: %s", exc)
