"""Publishing generations to object storage: `publish` (one generation, `espn publish`) and
`Publisher` (every generation of an index, polled; espn.live.replication.fenced.FencedWriter,
what `espn serve --publish` runs, builds on it)."""

from __future__ import annotations

import calendar
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, TypeVar

from espn.errors import EspnError, InvalidParameterError, ObjectStoreError, RefusedInputError
from ...generation.format import held_generation, read_current
from espn.untrusted import read_json_file

from .fence import NumberTaken, advance_latest, upload_pieces, write_record
from .retention import apply_retention
from .store import (ObjectStoreUrl, OncePerCause, failure_cause, latest_name, make_client, pieces_of, read_record,
                    stored_blobs)

__all__ = ["PublishResult", "publish", "Publisher"]

log = logging.getLogger(__name__)

P = TypeVar("P", bound="Publisher")


@dataclasses.dataclass(frozen=True)
class PublishResult:
    generation: int
    uploaded: int
    uploaded_bytes: int
    already_there: int



def publish(index: Path, url: str, client: Any = None, stored: set[str] | None = None) -> PublishResult:
    """Upload the index's current generation (what is not stored yet), then its record, then LATEST.

    The record is written only once every blob it names is known to be on the store: found by
    a HEAD (or in `stored`), or uploaded by this call; and only where no record of that number
    is (one holding this same generation counts as written). LATEST moves by a conditional
    write, never back, and never on a prefix a leased writer publishes to
    (espn.live.replication.fence). `client`: a boto3 S3 client to reuse (one is made by
    default). `stored`: sha256s of blobs checked on the store lately (by a listing or a HEAD;
    not asked again; what this publish finds or uploads is added).
    """
    index, where = Path(index), ObjectStoreUrl.parse(url)
    if not (index / "manifest.json").is_file():
        raise InvalidParameterError(f"{index}: not an espn index (no manifest.json)")
    client = client or make_client()
    known = stored if stored is not None else set()
    with held_generation(index) as generation:
        pieces = pieces_of(index, generation)
        uploaded, uploaded_bytes, there = upload_pieces(client, where, index, pieces, known)
        try:
            write_record(client, where, generation, pieces, None)
        except NumberTaken:
            raise ObjectStoreError(f"{where.url('generations/' + generation.file_name)} holds another generation "
                                   f"{generation.number} (another index's, or a writer's that published there); "
                                   "nothing was published: publish to a prefix of its own") from None
        advance_latest(client, where, generation.file_name, None)
    log.info("%s: generation %d published to %s (%d blobs uploaded, %d bytes; %d already there)", index,
             generation.number, url, uploaded, uploaded_bytes, there)
    return PublishResult(generation.number, uploaded, uploaded_bytes, there)


class Publisher:
    """Publishes every generation of a served index to `url` (`espn serve --publish`): the writer's half.

    A thread looks at live/CURRENT every `interval_s` and publishes when it moved (writes from
    any worker, compactions). One process per index publishes: the one holding the flock on
    live/publish.lock (a worker that dies lets another take it). What was published last, and
    the last error, are kept in live/PUBLISHED so that every worker's /readyz reports the same.
    A write is acknowledged when it is committed on this machine's disk, before its upload:
    replication is asynchronous, as in a database with asynchronous replicas, and the lag is
    reported. When the store is away, writes go on and publish when it returns.

    It checks rather than remembers: blobs are known to be stored only from a listing, a HEAD
    or its own upload; what it knows is forgotten after any store error, and every
    `verify_every_s` (60 polls by default) a listing and the published record are compared:
    a store that lost objects (restored from an old backup, emptied, a bucket recreated) makes
    the status stale and the current generation is published again, missing blobs uploaded.
    The thread never dies: a failure is recorded, logged once per cause, and retried with a
    backoff of up to 16 polls (30 s at most).
    """

    # Retention runs after a publish at most this often (it lists the whole prefix).
    RETENTION_EVERY_S = 600.0

    def __init__(self, url: str, index: Path, interval_s: float = 1.0, keep: int | None = None,
                 verify_every_s: float | None = None) -> None:
        self.where = ObjectStoreUrl.parse(url)
        self.url, self.index, self.interval_s, self.keep = url, Path(index), interval_s, keep
        self.verify_every_s = 60 * interval_s if verify_every_s is None else verify_every_s
        self.max_backoff_s = max(interval_s, min(30.0, 16 * interval_s))  # between attempts while they fail
        self._retained_at = 0.0  # the first publish applies retention
        # Blobs seen on the store lately (by a listing, a HEAD or an upload): a publish asks the
        # store only about new pieces. None: a full check is due (at start, after an error, and
        # every verify_every_s), which lists the store and compares the published record.
        self._stored: set[str] | None = None
        self._checked_at = 0.0
        self._republish = False  # the store lost (part of) what was published: publish again
        self._failures = 0
        self._warnings = OncePerCause(log)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock_fd = -1
        self._client: Any = None
        self._record_lock = threading.Lock()

    @property
    def _state_path(self) -> Path:
        return self.index / "live" / "PUBLISHED"

    def start(self: P) -> P:
        self._thread = threading.Thread(target=self._run, name="espn-publish", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; the process holding the lock publishes what is committed one last time."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        if self._owns_lock():
            try:
                self.publish_once()
            except Exception as exc:  # noqa: BLE001 - shutting down: say what the store lacks, then stop
                error = str(exc) if isinstance(exc, EspnError) else failure_cause(exc)
                number: object = "?"
                with contextlib.suppress(Exception):
                    number = read_current(self.index).number
                log.warning("publishing %s to %s at shutdown: the final upload failed: %s (generation %s is "
                            "committed here but not on the store; the next `espn serve --publish` or `espn "
                            "publish` uploads it)", self.index, self.url, error, number)
                with contextlib.suppress(Exception):
                    self._record(error=error)
            os.close(self._lock_fd)
            self._lock_fd = -1

    @property
    def alive(self) -> bool:
        """Whether the publishing thread runs (it only ends at stop())."""
        return self._thread is not None and self._thread.is_alive()

    def _owns_lock(self) -> bool:
        if self._lock_fd >= 0:
            return True
        path = self.index / "live" / "publish.lock"
        path.parent.mkdir(exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            delay = self.interval_s
            try:
                if self._owns_lock():
                    self.publish_once()
                    self._failures = 0
                    self._warnings.resolved(f"publishing {self.index} to {self.url}: the store answers again")
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any failure: record, retry later
                self._failures += 1
                delay = min(self.max_backoff_s, self.interval_s * 2 ** min(self._failures, 10))
                self._failed(exc)
            self._stop.wait(delay)

    def _failed(self, exc: Exception) -> None:
        """After a failure: a fresh client and a full check next time; the error in live/PUBLISHED, logged once."""
        self._client, self._stored = None, None  # the endpoint, credentials or the store's contents may have changed
        error = str(exc) if isinstance(exc, EspnError) else failure_cause(exc)
        self._warnings.warning(f"publishing {self.index} to {self.url}: {error} (writes go on; retrying, "
                               f"{self.max_backoff_s:g} s apart at most)")
        try:
            self._record(error=error)
        except Exception as state_error:  # noqa: BLE001 - e.g. a full disk: still retry, say so once
            self._warnings.warning(f"publishing {self.index}: cannot record the state in {self._state_path}: "
                                   f"{failure_cause(state_error)}")

    def publish_once(self) -> int | None:
        """Publish the current generation if it is not published (or the store lost it); its number, or None."""
        current = read_current(self.index).number
        if self._stored is None or time.monotonic() - self._checked_at > self.verify_every_s:
            self._check_store()
        if current == self._published().get("generation") and not self._republish:
            return None
        number = self._publish_current()
        self._republish = False
        self._record(generation=number)
        if self.keep is not None and time.monotonic() - self._retained_at > self.RETENTION_EVERY_S:
            self._retained_at = time.monotonic()
            self._stored = None  # retention deletes blobs: list again before the next publish
            apply_retention(self.url, self.keep)
        return number

    def _publish_current(self) -> int:
        """Publish the current generation; its number."""
        client = self._store_client()
        assert self._stored is not None  # set by _check_store
        return publish(self.index, self.url, client, self._stored).generation

    def _store_client(self) -> Any:
        """The boto3 client, made once (a client costs tens of ms to make) and again after a failure."""
        self._client = self._client or make_client()
        return self._client

    def _check_store(self) -> None:
        """List the store's blobs (what the next publish need not upload) and check that the
        published generation's record, its blobs and LATEST are all still there."""
        # What was published is read before the listing: a publish that lands in between (a
        # fenced writer's write path publishes beside this thread) is then not taken for a loss.
        published = self._published().get("generation")
        stored = stored_blobs(self._store_client(), self.where)
        problem = None
        if published is not None:
            name = f"gen-{int(published):06d}.json"
            checked = read_record(self._store_client(), self.where, name)
            latest = latest_name(self._store_client(), self.where)
            if checked is None:
                problem = f"its record {self.where.url(f'generations/{name}')} is missing"
            else:
                missing = [piece for piece in checked[1] if piece.sha256 not in stored]
                if missing:
                    problem = (f"{len(missing)} of its {len(checked[1])} blobs are missing (the first: "
                               f"{self.where.url(f'blobs/{missing[0].sha256}')}, {missing[0].path})")
                elif latest is None or latest < name:
                    problem = f"{self.where.url('LATEST')} names {latest or 'nothing'}"
            if problem is not None:
                problem = f"the store lost generation {published}: {problem}; publishing it again"
                # Recorded before it is logged: whoever reads the log line must already see the
                # generation as unpublished in /readyz, not the old "published" until the re-upload ends.
                self._record(error=problem, lost=True)
                self._warnings.warning(f"publishing {self.index} to {self.url}: {problem}")
                self._republish = True
        self._stored, self._checked_at = stored, time.monotonic()

    def _published(self) -> dict[str, Any]:
        try:  # a small file of this publisher's, read like anything on disk: bounded, a regular file
            state = read_json_file(self._state_path, "publish state", max_bytes=64 << 10)
        except (OSError, RefusedInputError):
            return {}
        return dict(state) if isinstance(state, dict) else {}

    def _record(self, generation: int | None = None, error: str | None = None, lost: bool = False) -> None:
        """live/PUBLISHED: the generation the store holds whole (None once it lost it), the last error."""
        with self._record_lock:  # the publishing thread and a fenced writer's write path
            state = self._published()
            if generation is not None:
                state.update(generation=generation, published_at=time.time())
            if lost:
                state["generation"] = None
            state["error"] = error
            state["attempt_at"] = time.time()
            # Not write_json_atomic: its live/PUBLISHED.tmp is a *.tmp in live/, which the writer's
            # crash recovery removes under the writer lock, not this one; the rename then failed.
            scratch = self._state_path.with_name("PUBLISHED.next")
            with open(scratch, "w", encoding="utf-8") as f:
                json.dump(state, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(scratch, self._state_path)

    def status(self) -> dict[str, Any]:
        """What /readyz reports: generations committed here but not yet on object storage, and
        stale while the last attempt failed or the store lost what was published."""
        current = read_current(self.index)
        state = self._published()
        published = state.get("generation")
        behind = current.number - published if published is not None else current.number + 1
        lag_s = 0.0
        if behind > 0:  # since the last publish (or, before the first, since this generation was committed)
            since = state.get("published_at")
            if since is None and current.created:
                since = calendar.timegm(time.strptime(current.created, "%Y-%m-%dT%H:%M:%SZ"))
            lag_s = max(0.0, time.time() - float(since or time.time()))
        stale = state.get("error") is not None
        return {"target": self.url, "generation": current.number, "published_generation": published,
                "lag_generations": max(0, behind), "lag_seconds": round(lag_s, 1), "stale": stale,
                "last_error": state.get("error")}
