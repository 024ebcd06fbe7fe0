"""The writer lease of a partition: an object on the store, taken and renewed by conditional writes.

`LEASE` under the partition's prefix names the writer that may publish there: its holder id
(a stable name, such as the pod's, and a random part per process start), its epoch, the URL
it takes writes at, and the lease's length. Every write of it is conditional (`If-None-Match`
to create it, `If-Match` on the ETag last read to renew, take over or release it), so two
processes never both believe they took it.

Expiry is observed, never computed from another machine's clock: a standby that finds the
same ETag for a whole lease length (on its own monotonic clock) takes the lease over with the
next epoch. The holder counts its lease from the moment it sent the renewal that the store
accepted, so its lease ends before any standby can see it expire: it stops acknowledging
writes at `valid_until` (espn.live.replication.fenced) and a standby takes over only later.
A holder that stops cleanly releases the lease, so a standby takes over at its next look.
A process restarted under the same name takes its own previous lease over at once (its
previous incarnation is gone; if it is not, the fence on LATEST still stops it).

The lease decides who tries to publish; the fence (espn.live.replication.fence) makes sure a
writer that lost it publishes nothing: the epoch in LATEST and in every record it writes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
import uuid
from typing import Any, Callable

from espn.choices import DEFAULT_LEASE_S, MAX_LEASE_S, MIN_LEASE_S
from espn.errors import IndexCorruptError, InvalidParameterError
from espn.untrusted import load_json

from .store import ObjectStoreUrl, put_if, read_object_tagged

__all__ = ["LEASE", "DEFAULT_LEASE_S", "MIN_LEASE_S", "MAX_LEASE_S", "LeaseRecord", "Lease", "read_lease"]

log = logging.getLogger(__name__)

LEASE = "LEASE"
_MAX_LEASE_BYTES = 4096
_NAME = re.compile(r"[A-Za-z0-9._:@-]{1,100}\Z")
_HOLDER = re.compile(r"[A-Za-z0-9._:@-]{1,100}/[0-9a-f]{12}\Z")


@dataclasses.dataclass(frozen=True)
class LeaseRecord:
    """The LEASE object. holder: `name/xxxxxxxxxxxx`, one per process start; url: where it takes writes
    ("" when it advertises none); renewals: counts renewals, so that each one changes the bytes."""

    holder: str
    name: str
    epoch: int
    url: str
    lease_s: float
    renewals: int = 0
    released: bool = False

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, body: bytes, what: str) -> "LeaseRecord":
        """The record, checked field by field (it comes from the store: data, bounded)."""
        obj = load_json(body, what, max_bytes=_MAX_LEASE_BYTES, error=IndexCorruptError, finite=True)
        try:
            record = cls(str(obj["holder"]), str(obj["name"]), int(obj["epoch"]), str(obj.get("url", "")),
                         float(obj["lease_s"]), int(obj.get("renewals", 0)), bool(obj.get("released", False)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise IndexCorruptError(f"{what}: not a writer lease ({type(exc).__name__}: {exc})") from None
        if not _HOLDER.match(record.holder) or not _NAME.match(record.name) or record.epoch < 1 \
                or not MIN_LEASE_S <= record.lease_s <= MAX_LEASE_S or len(record.url) > 500:
            raise IndexCorruptError(f"{what}: not a writer lease (holder {record.holder[:120]!r}, epoch "
                                    f"{record.epoch}, lease {record.lease_s} s)")
        return record


def read_lease(client: Any, where: ObjectStoreUrl) -> tuple[LeaseRecord, str] | None:
    """The partition's lease and its ETag, None when no writer ever took it."""
    found = read_object_tagged(client, where, LEASE, _MAX_LEASE_BYTES)
    return None if found is None else (LeaseRecord.parse(found[0], where.url(LEASE)), found[1])


class Lease:
    """One process's side of a partition's lease: take it, renew it, give it back, or watch it.

    Not tied to a thread; calls are serialised by a lock. `valid_until` (time.monotonic) is when
    this process must stop acknowledging writes unless a renewal succeeds first."""

    def __init__(self, client: Callable[[], Any], where: ObjectStoreUrl, name: str, url: str = "",
                 lease_s: float = DEFAULT_LEASE_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not _NAME.match(name):
            raise InvalidParameterError(f"writer name {name[:120]!r}: 1 to 100 letters, digits and ._:@- (a pod name)")
        if not MIN_LEASE_S <= lease_s <= MAX_LEASE_S:
            raise InvalidParameterError(f"lease_s must be in [{MIN_LEASE_S:g}, {MAX_LEASE_S:g}], got {lease_s}")
        self._client, self.where, self.name, self.url, self.lease_s, self._clock = client, where, name, url, lease_s, clock
        self.holder = f"{name}/{uuid.uuid4().hex[:12]}"
        self._mutex = threading.Lock()
        self._held: tuple[LeaseRecord, str] | None = None
        self._seen: tuple[str, float] | None = None  # (ETag of another holder's lease, when first seen)
        self._first_look = True
        self.valid_until = 0.0

    @property
    def held(self) -> LeaseRecord | None:
        return self._held[0] if self._held is not None else None

    @property
    def epoch(self) -> int:
        return self._held[0].epoch if self._held is not None else 0

    def valid(self, margin_s: float = 0.0) -> bool:
        return self._held is not None and self._clock() + margin_s < self.valid_until

    def read(self) -> tuple[LeaseRecord, str] | None:
        return read_lease(self._client(), self.where)

    def try_acquire(self, min_epoch: int = 0) -> bool:
        """Take the lease if no one holds it, its holder released it or let it expire (observed
        here), or it is this name's previous process (at the first look only). The new epoch is
        above the old one and above `min_epoch` (LATEST's). True when this process holds it."""
        with self._mutex:
            found = self.read()
            now = self._clock()
            if found is not None and self._held is not None and found[0].holder == self.holder:
                return True
            first, self._first_look = self._first_look, False
            if found is not None and not (found[0].released or (first and found[0].name == self.name)):
                etag = found[1]
                if self._seen is None or self._seen[0] != etag:
                    self._seen = (etag, now)
                    return False
                if now - self._seen[1] < found[0].lease_s:
                    return False
                log.warning("%s: the lease of %s (epoch %d) was not renewed for %.1f s; taking the partition over",
                            self.where.url(LEASE), found[0].holder, found[0].epoch, now - self._seen[1])
            epoch = max(found[0].epoch if found is not None else 0, min_epoch) + 1
            record = LeaseRecord(self.holder, self.name, epoch, self.url, self.lease_s)
            written = put_if(self._client(), self.where, LEASE, record.to_bytes(),
                             if_match=found[1] if found is not None else None, if_absent=found is None)
            self._seen = None
            if written is None:
                return False  # another process took it first
            self._held, self.valid_until = (record, written), now + self.lease_s
            log.info("%s: %s holds the writer lease, epoch %d", self.where.url(LEASE), self.holder, epoch)
            return True

    def renew(self) -> bool:
        """Renew the lease: True while this process holds it (valid for another lease length from
        the moment the renewal was sent), False once another holds it. A store that does not
        answer raises (ObjectStoreError) and the lease runs on towards `valid_until`."""
        with self._mutex:
            if self._held is None:
                return False
            record, etag = self._held
            renewed = dataclasses.replace(record, renewals=record.renewals + 1)
            sent = self._clock()
            new_etag = put_if(self._client(), self.where, LEASE, renewed.to_bytes(), if_match=etag)
            if new_etag is None:
                found = self.read()  # the write may have landed and its answer been lost
                if found is None or found[0] != renewed:
                    self._lost(found)
                    return False
                new_etag = found[1]
            self._held, self.valid_until = (renewed, new_etag), sent + self.lease_s
            return True

    def _lost(self, found: tuple[LeaseRecord, str] | None) -> None:
        who = f"{found[0].holder} (epoch {found[0].epoch})" if found is not None else "no one"
        log.warning("%s: the writer lease is lost: %s holds it now", self.where.url(LEASE), who)
        self._held, self.valid_until = None, 0.0

    def drop(self) -> None:
        """Forget the lease here (superseded): acknowledge nothing more under it."""
        with self._mutex:
            self._held, self.valid_until = None, 0.0

    def release(self) -> None:
        """Give the lease back (a clean stop): a standby takes over at its next look."""
        with self._mutex:
            if self._held is None:
                return
            record, etag = self._held
            self._held, self.valid_until = None, 0.0
            put_if(self._client(), self.where, LEASE, dataclasses.replace(record, released=True).to_bytes(),
                   if_match=etag)
            log.info("%s: %s released the writer lease (epoch %d)", self.where.url(LEASE), self.holder, record.epoch)
