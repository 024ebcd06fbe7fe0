"""A read replica: a local index directory kept at the newest generation published to object storage."""

from __future__ import annotations

import calendar
import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from espn.errors import EspnError, IndexLockedError, ObjectStoreError
from ...generation.format import LIVE_DIR, read_current

from ..writer import IndexWriter
from .cluster import Registration, member_name
from .restore import fetch_piece
from .store import ObjectStoreUrl, OncePerCause, failure_cause, latest_name, make_client, read_record

__all__ = ["Follower"]

log = logging.getLogger(__name__)


class Follower:
    """Keeps a local index directory at the newest generation published at `url` (a read replica).

    Each poll reads `LATEST` and its record, checked against the index layout before anything
    it names is fetched; a newer generation's pieces that the local copy lacks are fetched
    under the local writer lock (so a crash mid-fetch is undone by the next one's recovery, and
    two server workers never fetch at once), each landing beside its target and renamed into
    place once its sha256 matches, and the generation record is committed last: readers never
    open a half-transferred generation. When the store cannot be reached, or what it holds is
    refused, the local copy keeps serving its last generation and reports itself stale with
    the error in one sentence (logged once per cause, not at every poll).
    """

    def __init__(self, url: str, index: Path, interval_s: float = 2.0, advertise_url: str = "") -> None:
        self.where, self.url, self.index, self.interval_s = ObjectStoreUrl.parse(url), url, Path(index), interval_s
        # With an advertised URL, a replica of its partition for `espn route --shard-map` (espn.live.replication.cluster).
        self.registration = Registration(self.where, member_name(advertise_url), advertise_url)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._source_generation: int | None = None
        self._source_created = ""
        self._last_contact = 0.0
        self._last_error: str | None = None
        self._warnings = OncePerCause(log)
        self._client: Any = None  # made at the first poll, then reused (boto3 clients are thread-safe)

    def start(self) -> "Follower":
        self._thread = threading.Thread(target=self._run, name="espn-follow", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        with contextlib.suppress(Exception):  # a replica that did not say goodbye ages out of the routers' view
            self.registration.leave(self._client or make_client())

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
                self.registration.beat(self._client, "replica", read_current(self.index).number)
                with self._lock:
                    self._last_error = None
                self._warnings.resolved(f"following {self.url}: fetching again")
            except Exception as exc:  # noqa: BLE001 - the store is away or what it holds is bad: keep serving, retry
                error = str(exc) if isinstance(exc, EspnError) else failure_cause(exc)
                with self._lock:
                    self._last_error = error
                with contextlib.suppress(Exception):
                    error = f"{error} (still serving generation {read_current(self.index).number})"
                self._warnings.warning(f"following {self.url}: {error}")
            self._stop.wait(self.interval_s)

    def poll_once(self) -> int | None:
        """Fetch and commit the newest published generation if it is newer; its number, or None."""
        client = self._client = self._client or make_client()
        name = latest_name(client, self.where)
        if name is not None:
            with self._lock:  # what the store says is newest, even when its record is then refused
                self._source_generation, self._source_created = int(name[4:10]), ""
                self._last_contact = time.monotonic()
        checked = read_record(client, self.where, name) if name is not None else None
        if checked is None:
            raise ObjectStoreError(f"{self.url}: no published generation there "
                                   f"({self.where.url(f'generations/{name}' if name else 'LATEST')} does not exist)")
        remote, pieces = checked
        with self._lock:
            self._source_generation, self._source_created = remote.number, remote.created
        if remote.number <= read_current(self.index).number:
            return None
        what = self.where.url(f"generations/{name}")
        self._drop_links()
        writer = IndexWriter(self.index)  # no side index: the pieces fetched hold them
        try:
            with writer.locked(0.0) as current:
                if remote.number <= current.number:
                    return None
                # Whole files this index holds already, by content: a piece with the same bytes under
                # another path (a rewritten base's encoder) is linked, not fetched and stored again.
                local = {needed.sha256: needed.path for needed in current.needed_files()
                         if needed.sha256 is not None and needed.range is None and not needed.path.endswith("embeddings.bin")}
                for piece in sorted(pieces, key=lambda p: p.start):  # a file's ranges in order
                    fetch_piece(client, self.where, self.index, piece, what, local)
                writer.commit(remote, fetched=True)
        except IndexLockedError:
            return None  # another worker of this server is fetching it
        log.info("following %s: generation %d fetched and served", self.url, remote.number)
        return remote.number

    def _drop_links(self) -> None:
        """Remove symbolic links from live/ (a follower's directory holds only what it fetched):
        never followed, not by the writer's recovery either; what they stood for is fetched again."""
        live = self.index / LIVE_DIR
        try:
            entries = list(os.scandir(live))
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.is_symlink():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                log.warning("following %s: %s is a symbolic link, not a file this follower fetched; removed (not "
                            "followed), what it stood for is fetched again", self.url, entry.path)

    def status(self) -> dict[str, Any]:
        """What /readyz reports: the local and the source's generation, the lag, and staleness
        (no contact with the store lately, or the last poll failed)."""
        local = read_current(self.index)
        with self._lock:
            source, created, contact, error = (self._source_generation, self._source_created, self._last_contact,
                                               self._last_error)
        behind = max(0, (source or local.number) - local.number)
        lag_s = 0.0
        if behind and created:
            lag_s = max(0.0, time.time() - calendar.timegm(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ")))
        stale = error is not None or contact == 0.0 or time.monotonic() - contact > 3 * self.interval_s + 5
        return {"source": self.url, "generation": local.number, "source_generation": source,
                "lag_generations": behind, "lag_seconds": round(lag_s, 1), "stale": stale, "last_error": error}
