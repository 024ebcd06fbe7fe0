"""A fenced writer: `espn serve INDEX --publish s3://BUCKET/PREFIX`, one of one or more per partition.

`FencedWriter` is the partition's writer while it holds the lease (espn.live.replication.lease)
and a follower of the prefix while another process does (a standby), so that a second writer
started for the same partition stands by instead of publishing over the first.

The leader publishes each generation to the store *before* committing it on its own disk,
and a write is acknowledged only after both (the write path calls `publish` through
espn.live.writer.WriteFence, under the writer lock; group commit puts the writes that arrive
meanwhile into the next generation, so one upload serves many writes). So every acknowledged
write is in a generation LATEST names, and the local copy never holds a generation the store
lacks: whatever happens to this machine, the store has every acknowledged write, and a writer
that loses the partition is a prefix of the store's history and follows it from there.

Losing the partition, in every way it can happen:
- it crashes (`kill -9`): nothing unpublished was acknowledged; the standby takes the lease over
  once it has seen it unrenewed for a whole lease length, fences LATEST under its new epoch,
  catches up to what LATEST names, and takes writes;
- it is paused (`SIGSTOP`) or cut off from the store past its lease: it stops acknowledging at
  the end of its lease (each publish checks the lease first and renews it when due), and when
  it resumes, its renewal or its conditional write of LATEST fails: it is superseded, answers
  writes with WriterSupersededError (503 `writer_superseded`) at once, and follows;
- it stops cleanly: it releases the lease and the standby takes over at its next look.

The publishing thread of espn.live.replication.publisher.Publisher carries the lease (renewing
it every third of its length, or watching it while standing by) as well as the periodic check
that the store still holds what was published. One process per index: `--publish` runs one
server worker.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from espn.errors import (EspnError, IndexCorruptError, ObjectStoreError, WriteFailedError, WriterStandbyError,
                         WriterSupersededError)
from espn.files.durable import write_json_atomic
from espn.generation.format import LIVE_DIR, Generation, read_current, record_number
from espn.partitioning import PartitionLayout

from ..encoding import documents_encoded
from ..live_index import LiveIndex
from ..writer import FENCED_FILE, IndexWriter
from .cluster import Registration
from .fence import FenceToken, fence_latest, publish_fenced
from .follower import Follower
from .lease import DEFAULT_LEASE_S, Lease, LeaseRecord
from .publisher import Publisher
from .slots import SlotKeeper
from .store import Latest, OncePerCause, read_latest, stored_blobs

__all__ = ["FencedWriter", "LEADER", "STANDBY"]

log = logging.getLogger(__name__)

LEADER, STANDBY = "leader", "standby"
#: How long before its lease ends a writer stops counting on it (renews before it publishes).
_MARGIN_FRACTION = 0.2
#: Fetches a takeover may need to reach what LATEST names before it gives the lease back.
_CATCH_UP_TRIES = 5


class FencedWriter(Publisher):
    """The writer of a partition while it holds the lease, a follower while it does not.

    name: this process's stable name (a pod name); url: where it takes writes, advertised in the
    lease for the router (may be ""). lease_s: the lease's length; a standby takes over after
    seeing it unrenewed that long. The object is the write path's fence (espn.live.writer.WriteFence).
    """

    def __init__(self, url: str, index: Path, interval_s: float = 0.5, keep: int | None = None, *, name: str,
                 advertise_url: str = "", lease_s: float = DEFAULT_LEASE_S, wait_s: float = 10.0,
                 shard_map: str | None = None, verify_every_s: float | None = None) -> None:
        super().__init__(url, index, interval_s, keep, verify_every_s)
        self.lease = Lease(self._store_client, self.where, name, advertise_url, lease_s)
        self.follower = Follower(url, index, interval_s)
        self.registration = Registration(self.where, name, advertise_url)
        # With a shard map: ownership by its slots, and this partition's part in its moves.
        self.slots = SlotKeeper(shard_map, url) if shard_map is not None else None
        self._moves: threading.Thread | None = None
        self.wait_s = wait_s
        self.role = STANDBY
        self._superseded: str | None = None  # why this writer lost the partition (until it leads again)
        self._latest: Latest | None = None  # LATEST as this writer last wrote or read it
        self._seen: LeaseRecord | None = None  # the lease as last read while standing by
        self._renewed_at = 0.0
        self._mutex = threading.RLock()  # role changes (publishes are serialised by the writer lock)

    # -- the write path (espn.live.writer.WriteFence) ------------------------------------------
    def admit(self, doc_ids: Sequence[str], layout: PartitionLayout) -> None:
        """WriterSupersededError / WriterStandbyError unless this process leads; then the layout's check."""
        if self.role != LEADER:
            where = self._leader_words()
            if self._superseded is not None:
                raise WriterSupersededError(f"this writer of {self.url} was superseded ({self._superseded}); {where}")
            raise WriterStandbyError(f"this server stands by for {self.url}: {where}")
        self.readmit(doc_ids, layout)

    def readmit(self, doc_ids: Sequence[str], layout: PartitionLayout) -> None:
        """The ids' slots: the shard map's (owned, not frozen by a move), else the build's layout."""
        if self.slots is not None:
            self.slots.admit(self._store_client, doc_ids)
        else:
            layout.check_owned(doc_ids)

    def publish(self, root: Path, generation: Generation) -> Generation:
        """Publish a generation the writer staged (under its lock) under this writer's epoch: the
        lease is renewed first when it is close to its end. WriteFailedError when the store does
        not take it (nothing is acknowledged; the write may be retried), WriterSupersededError
        when another writer took the partition over."""
        self._require_leader()
        if not self.lease.valid(_MARGIN_FRACTION * self.lease.lease_s):
            self._renew()
            self._require_leader()
        return self._publish_locked(generation, renumber=True)

    def _require_leader(self) -> None:
        if self.role != LEADER:
            raise WriterSupersededError(f"this writer of {self.url} lost the partition "
                                        f"({self._superseded or 'its lease ended'}); {self._leader_words()}")

    def _publish_locked(self, generation: Generation, renumber: bool) -> Generation:
        token = FenceToken(self.lease.epoch, self.lease.holder)
        client = self._store_client()
        try:
            if self._stored is None:  # a listing, once: a new piece is then uploaded without a HEAD first
                self._stored, self._checked_at = stored_blobs(client, self.where), time.monotonic()
            published = publish_fenced(client, self.where, self.index, generation, token, self._stored,
                                       self._latest if renumber else None, renumber=renumber)
        except WriterSupersededError as exc:
            self._lose(str(exc))
            raise
        except (ObjectStoreError, IndexCorruptError) as exc:
            self._client, self._stored, self._latest = None, None, None  # look again next time
            raise WriteFailedError(f"generation {generation.number} was not published to {self.url}: {exc}; nothing "
                                   "of it was acknowledged (retry)") from exc
        self._latest = published.latest
        self._record(generation=published.generation.number)
        return published.generation

    def _renew(self) -> None:
        """Renew the lease now; a lost lease makes this writer a follower."""
        sent = time.monotonic()
        try:
            held = self.lease.renew()
        except ObjectStoreError as exc:
            if not self.lease.valid():
                raise WriterStandbyError(f"this writer's lease on {self.url} ran out and cannot be renewed: {exc}; "
                                         "nothing more is acknowledged until it is") from exc
            raise WriteFailedError(f"the writer lease on {self.url} could not be renewed: {exc} (retry)") from exc
        if not held:
            self._lose("its lease is gone or another writer holds it")
            return
        self._renewed_at = sent

    def _lose(self, why: str) -> None:
        """Superseded: acknowledge nothing more, follow the store from now on."""
        with self._mutex:
            if self.role == LEADER:
                log.warning("%s: superseded (%s); acknowledging no more writes and following the store", self.url, why)
            self.lease.drop()
            self.role, self._superseded, self._latest = STANDBY, why, None
        with contextlib.suppress(OSError):
            self._record(error=f"superseded: {why}")

    def _leader_words(self) -> str:
        seen = self.lease.held or self._seen
        if seen is None:
            return "no writer holds the lease yet; retry"
        where = f" at {seen.url}" if seen.url else ""
        return f"the writer is {seen.name}{where} (epoch {seen.epoch}); send writes there"

    # -- the thread: renew while leading, follow and watch the lease while standing by ---------
    def _run(self) -> None:
        tick = min(self.interval_s, self.lease.lease_s / 4)
        while not self._stop.is_set():
            delay = tick
            try:
                if self.role == LEADER:
                    self._lead()
                else:
                    self._stand_by()
                self.registration.beat(self._store_client(), self.role, read_current(self.index).number)
                self._failures = 0
                self._warnings.resolved(f"{self.url}: the store answers again")
            except Exception as exc:  # noqa: BLE001 - the thread outlives any failure: record, retry
                self._failures += 1
                delay = min(tick * 2 ** min(self._failures, 6), self.max_backoff_s, self.lease.lease_s / 4)
                self._failed(exc)
            self._stop.wait(delay)

    def _lead(self) -> None:
        if time.monotonic() - self._renewed_at >= self.lease.lease_s / 3:
            self._renew()  # never behind the writer lock or a publish: a slow upload must not let the lease lapse
        if self.role == LEADER and self._owns_lock():
            self.publish_once()  # only when the store lost what was published, or a generation is unpublished

    def _stand_by(self) -> None:
        if self._owns_lock():
            with contextlib.suppress(EspnError):  # the follower records its own errors; the lease is watched anyway
                self.follower.poll_once()
        found = self.lease.read()
        self._seen = found[0] if found is not None else None
        latest = read_latest(self._store_client(), self.where)
        if self._owns_lock() and self.lease.try_acquire(latest.epoch if latest is not None else 0):
            self._take_over()

    def _take_over(self) -> None:
        """Fence LATEST under the new epoch, bring the local copy to what it names, then lead."""
        token = FenceToken(self.lease.epoch, self.lease.holder)
        sent = time.monotonic()
        try:
            latest = fence_latest(self._store_client(), self.where, token)
            ahead = self._catch_up(latest)
        except BaseException:
            self.lease.drop()
            raise
        with self._mutex:
            self._latest, self._renewed_at, self._stored = latest, sent, None
            self.role, self._superseded = LEADER, None
        write_json_atomic(self.index / LIVE_DIR / FENCED_FILE, {"url": self.url, "holder": self.lease.holder})
        log.info("%s: leading at epoch %d from generation %d", self.url, token.epoch, read_current(self.index).number)
        if ahead:
            self.publish_once()
        if self.slots is not None and (self._moves is None or not self._moves.is_alive()):
            self._moves = threading.Thread(target=self._tend_moves, name="espn-moves", daemon=True)
            self._moves.start()

    def _tend_moves(self) -> None:
        """While leading: this partition's part in the shard map's moves (a thread of its own: a
        bundle's download and publish must not hold up the lease's renewals)."""
        assert self.slots is not None  # started only with a shard map
        warnings = OncePerCause(log)
        writer = LiveIndex(self.index, fence=self)
        try:
            while not self._stop.is_set() and self.role == LEADER:
                try:
                    self.slots.tend(self._store_client(), lambda: writer, self.wait_s)
                    warnings.resolved(f"{self.url}: moves go on")
                except Exception as exc:  # noqa: BLE001 - retried at the next pass; the move waits for it
                    warnings.warning(f"{self.url}: a move step failed, retried: {exc}")
                self._stop.wait(self.interval_s)
        finally:
            writer.close()

    def _catch_up(self, latest: Latest | None) -> bool:
        """The local copy at LATEST's generation; True when it holds generations past it that
        descend from it (this directory published LATEST's generation) and are to be published."""
        if latest is None:
            return True  # nothing published yet: the first publish is this writer's current generation
        number = record_number(latest.name)
        assert number is not None  # Latest.parse checked the name
        for _ in range(_CATCH_UP_TRIES):
            local = read_current(self.index).number
            if local >= number:
                break
            self.follower.poll_once()
        local = read_current(self.index).number
        if local < number:
            raise ObjectStoreError(f"{self.url}: could not fetch generation {number} before taking writes "
                                   f"(the local copy is at {local}); the takeover is retried")
        if local > number and self._published().get("generation") != number:
            raise ObjectStoreError(f"{self.index} is at generation {local}, past the {number} that {self.url} "
                                   "holds, and not known to descend from it: restore it from the store "
                                   "(`espn restore`) before it writes there")
        return local > number

    # -- Publisher's hooks -----------------------------------------------------------------
    def publish_once(self) -> int | None:
        if self.role != LEADER:
            return None
        return super().publish_once()

    def _publish_current(self) -> int:
        """The background publish (a generation committed without the fence, or lost by the
        store), under the writer lock, as any publish of this writer."""
        with IndexWriter(self.index).locked(self.wait_s) as current:  # the write path's order: the lock, then the role
            self._require_leader()
            return self._publish_locked(current, renumber=False).number

    def stop(self) -> None:
        """Stop the thread; a leader publishes what is committed one last time and releases the
        lease, so that a standby takes over at its next look instead of after a lease length."""
        super().stop()
        if self._moves is not None:
            self._moves.join(60)
        with contextlib.suppress(Exception):  # a server that did not say goodbye ages out of the routers' view
            self.registration.leave(self._store_client())
        if self.role == LEADER:
            with self._mutex:
                self.role = STANDBY
                try:
                    self.lease.release()
                except EspnError as exc:
                    log.warning("%s: could not release the writer lease (%s); a standby takes over when it ends",
                                self.url, exc)

    def status(self) -> dict[str, Any]:
        """What /readyz reports: a leader's publishing status or a standby's following status,
        with the role, the epoch and where the partition's writer is."""
        base = super().status() if self.role == LEADER else self.follower.status()
        seen = self.lease.held or self._seen
        return {**base, "role": self.role, "epoch": self.lease.epoch or (seen.epoch if seen else 0),
                "writer": None if seen is None else {"name": seen.name, "url": seen.url, "epoch": seen.epoch},
                "lease_left_s": round(max(0.0, self.lease.valid_until - time.monotonic()), 1),
                "superseded": self._superseded, "documents_encoded": documents_encoded(),
                "live_documents": read_current(self.index).live_documents,
                "documents_ingested": self.slots.ingested if self.slots is not None else 0,
                "partition": self.slots.partition if self.slots is not None else None}
