"""Generations on object storage (S3 and what speaks its API: MinIO, Ceph, GCS's interoperability):
the durable copy of an index, and what a new machine restores from.

Layout under `s3://BUCKET/PREFIX/`:

    blobs/<sha256>              every file a generation needs, by content (so a file shared by
                                many generations is stored once, and a retry re-uploads nothing)
    generations/gen-NNNNNN.json the generation record, plus where each of its files' bytes are
    LATEST                      the name of the newest published generation record

`publish` holds the current generation (the writer's collector keeps its files), uploads the
blobs that are not there yet, each checked against the sha256 the generation records, then
the generation record, then LATEST: the record is the commit point, so a reader never finds a
generation whose bytes are not all stored. `embeddings.bin`, which the writer appends to, is
stored as the build's bytes and each delta's appended range, each its own blob. `restore`
reassembles a generation into a new index directory and verifies every byte before it is
renamed into place. Credentials and the endpoint come from boto3's usual chain (AWS_* variables,
`~/.aws`, an instance role; `AWS_ENDPOINT_URL` for a non-AWS store), never from the manifest.
"""

from __future__ import annotations

import calendar
import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from espn.errors import IndexCorruptError, InvalidParameterError
from espn.index import fsync_path, sha256_file, write_json_atomic
from espn.segments import Generation, held_generation, read_current

from .snapshot import new_directory, write_generation_record

__all__ = ["ObjectStoreUrl", "PublishResult", "Publisher", "Follower", "Retention", "publish", "restore_from_store",
           "apply_retention", "is_store_url"]

log = logging.getLogger(__name__)

_CHUNK = 8 << 20
# Test hook (tests/crash_serve.py): called at "uploaded" after each blob, to kill a writer mid-upload.
_checkpoint: Callable[[str], None] = lambda step: None


@dataclasses.dataclass(frozen=True)
class ObjectStoreUrl:
    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> "ObjectStoreUrl":
        if not url.startswith("s3://") or not url[5:].split("/", 1)[0]:
            raise InvalidParameterError(f"object store URL {url!r}: expected s3://BUCKET[/PREFIX]")
        bucket, _, prefix = url[5:].partition("/")
        return cls(bucket, prefix.strip("/"))

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name


@dataclasses.dataclass(frozen=True)
class PublishResult:
    generation: int
    uploaded: int
    uploaded_bytes: int
    already_there: int


def is_store_url(value: str | os.PathLike[str]) -> bool:
    return str(value).startswith("s3://")


def _client() -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise InvalidParameterError("object storage needs boto3: pip install 'espn[s3]'") from None
    return boto3.client("s3", config=Config(retries={"max_attempts": 5, "mode": "standard"}))


def _exists(client: Any, bucket: str, key: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        client.head_object(Bucket=bucket, Key=key)
        return True
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise


def _latest_name(client: Any, where: ObjectStoreUrl) -> str | None:
    """The record LATEST names (gen-NNNNNN.json sorts by number), or None before the first publish."""
    from botocore.exceptions import ClientError

    try:
        return str(client.get_object(Bucket=where.bucket, Key=where.key("LATEST"))["Body"].read().decode().strip())
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def _pieces(index: Path, generation: Generation) -> list[dict[str, Any]]:
    """Every stored piece of the generation: {path, start, stop, sha256} (start/stop: bytes of the file)."""
    pieces = []
    base = "" if generation.base == "." else f"{generation.base}/"
    manifest = f"{base}manifest.json"
    for needed in generation.needed_files():
        if needed.path == manifest:
            continue
        start, stop = needed.range if needed.range is not None else (0, needed.bytes)
        pieces.append({"path": needed.path, "start": start, "stop": stop, "sha256": needed.sha256})
    for path in {manifest, "manifest.json"}:  # the base's manifest (and the root's, which marks the index)
        pieces.append({"path": path, "start": 0, "stop": (index / path).stat().st_size,
                       "sha256": sha256_file(index / path)})
    return pieces


class _RangeReader(io.RawIOBase):
    """Bytes [start, stop) of a file as a readable stream (what boto3's upload_fileobj takes)."""

    def __init__(self, path: Path, start: int, stop: int) -> None:
        self._file = open(path, "rb")
        self._file.seek(start)
        self._left = stop - start

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer)[: self._left]
        done = self._file.readinto(view) if len(view) else 0
        self._left -= done
        return done

    def close(self) -> None:
        self._file.close()
        super().close()


def publish(index: Path, url: str, client: Any = None, stored: set[str] | None = None) -> PublishResult:
    """Upload the index's current generation (what is not stored yet), then its record, then LATEST.

    `client`: a boto3 S3 client to reuse (one is made by default). `stored`: sha256s of blobs
    known to be on the store (not asked again; what this publish finds or uploads is added).
    """
    index, where = Path(index), ObjectStoreUrl.parse(url)
    if not (index / "manifest.json").is_file():
        raise InvalidParameterError(f"{index}: not an espn index (no manifest.json)")
    client = client or _client()
    uploaded = uploaded_bytes = there = 0
    with held_generation(index) as generation:
        pieces = _pieces(index, generation)
        for piece in pieces:
            key = where.key(f"blobs/{piece['sha256']}")
            if stored is not None and piece["sha256"] in stored:
                there += 1
                continue
            if _exists(client, where.bucket, key):
                there += 1
                if stored is not None:
                    stored.add(piece["sha256"])
                continue
            path, start, stop = index / piece["path"], piece["start"], piece["stop"]
            if sha256_file(path, start, stop) != piece["sha256"]:
                raise IndexCorruptError(f"{path}: bytes {start}-{stop} do not match the generation's sha256; "
                                        "nothing of this generation was published")
            with _RangeReader(path, start, stop) as body:  # streamed (multipart when large), never whole in memory
                client.upload_fileobj(body, where.bucket, key)
            uploaded, uploaded_bytes = uploaded + 1, uploaded_bytes + stop - start
            if stored is not None:
                stored.add(piece["sha256"])
            _checkpoint("uploaded")
        record = {"generation": generation.to_json(), "pieces": pieces}
        name = f"gen-{generation.number:06d}.json"
        client.put_object(Bucket=where.bucket, Key=where.key(f"generations/{name}"),
                          Body=json.dumps(record).encode(), ContentType="application/json")
        newest = _latest_name(client, where)
        if newest is None or newest < name:  # never move LATEST back (a slower, older publish racing a newer one)
            client.put_object(Bucket=where.bucket, Key=where.key("LATEST"), Body=name.encode())
    log.info("%s: generation %d published to %s (%d blobs uploaded, %d bytes; %d already there)", index,
             generation.number, url, uploaded, uploaded_bytes, there)
    return PublishResult(generation.number, uploaded, uploaded_bytes, there)


def restore_from_store(url: str, dest: Path, generation: int | None = None) -> int:
    """A servable index directory at `dest` (new) from a generation on object storage (the newest
    by default), every byte verified; returns the generation's number."""
    from botocore.exceptions import ClientError

    where, dest = ObjectStoreUrl.parse(url), Path(dest)
    client = _client()
    try:
        name = f"gen-{generation:06d}.json" if generation is not None else \
            client.get_object(Bucket=where.bucket, Key=where.key("LATEST"))["Body"].read().decode().strip()
        record = json.loads(client.get_object(Bucket=where.bucket, Key=where.key(f"generations/{name}"))["Body"].read())
    except ClientError as exc:
        raise InvalidParameterError(f"{url}: no published generation there ({exc.response.get('Error', {}).get('Code')})") \
            from None
    published = Generation.from_json(record["generation"])
    with new_directory(dest, "a restore") as staging:
        for piece in record["pieces"]:
            target = staging / piece["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            body = client.get_object(Bucket=where.bucket, Key=where.key(f"blobs/{piece['sha256']}"))["Body"]
            digest, size = hashlib.sha256(), 0
            with open(target, "r+b" if target.exists() else "wb") as f:
                f.seek(piece["start"])
                for chunk in body.iter_chunks(_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
                    f.write(chunk)
            if size != piece["stop"] - piece["start"] or digest.hexdigest() != piece["sha256"]:
                raise IndexCorruptError(f"{url}: blob {piece['sha256'][:12]}… of {piece['path']} does not match its "
                                        "sha256 (corrupted in the store); nothing was restored")
        for path in {p["path"] for p in record["pieces"]}:
            fsync_path(staging / path)
        write_generation_record(staging, published)
        from espn.segments import open_view

        open_view(staging, verify="full").close()
    log.info("%s: generation %d restored from %s", dest, published.number, url)
    return published.number


class Publisher:
    """Publishes every generation of a served index to `url` (`espn serve --publish`): the writer's half.

    A thread looks at live/CURRENT every `interval_s` and publishes when it moved (writes from
    any worker, compactions). One process per index publishes: the one holding the flock on
    live/publish.lock (a worker that dies lets another take it). What was published last, and
    the last error, are kept in live/PUBLISHED so that every worker's /readyz reports the same.
    A write is acknowledged when it is committed on this machine's disk, before its upload:
    replication is asynchronous, as in a database with asynchronous replicas, and the lag is
    reported. When the store is away, writes go on and publish when it returns.
    """

    # Retention runs after a publish at most this often (it lists the whole prefix).
    RETENTION_EVERY_S = 600.0

    def __init__(self, url: str, index: Path, interval_s: float = 1.0, keep: int | None = None) -> None:
        ObjectStoreUrl.parse(url)
        self.url, self.index, self.interval_s, self.keep = url, Path(index), interval_s, keep
        self._retained_at = 0.0  # the first publish applies retention
        self._stored_since = time.monotonic()
        # Blobs this process stored or saw stored: a publish asks the store only about new pieces
        # (one HEAD per piece of every generation otherwise). Forgotten when retention runs and
        # every RETENTION_EVERY_S, so a blob collected meanwhile is asked about again.
        self._stored: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock_fd = -1
        self._client: Any = None

    @property
    def _state_path(self) -> Path:
        return self.index / "live" / "PUBLISHED"

    def start(self) -> "Publisher":
        self._thread = threading.Thread(target=self._run, name="espn-publish", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling; the process holding the lock publishes what is committed one last time."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
        if self._owns_lock():
            with contextlib.suppress(Exception):
                self.publish_once()
            os.close(self._lock_fd)
            self._lock_fd = -1

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
            if self._owns_lock():
                try:
                    self.publish_once()
                except Exception as exc:  # noqa: BLE001 - the store is away: writes go on, publish later
                    self._client = None  # a fresh one next time (the endpoint or credentials may have changed)
                    self._record(error=f"{type(exc).__name__}: {exc}")
            self._stop.wait(self.interval_s)

    def publish_once(self) -> int | None:
        """Publish the current generation if it is not published yet; its number, or None."""
        current = read_current(self.index).number
        if current == self._published().get("generation"):
            return None
        self._client = self._client or _client()  # made once: a boto3 client costs tens of ms to make
        if time.monotonic() - self._stored_since > self.RETENTION_EVERY_S:
            self._stored, self._stored_since = set(), time.monotonic()
        result = publish(self.index, self.url, self._client, self._stored)
        self._record(generation=result.generation)
        if self.keep is not None and time.monotonic() - self._retained_at > self.RETENTION_EVERY_S:
            self._retained_at = time.monotonic()
            self._stored = set()
            apply_retention(self.url, self.keep)
        return result.generation

    def _published(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self._state_path.read_text()))
        except (OSError, ValueError):
            return {}

    def _record(self, generation: int | None = None, error: str | None = None) -> None:
        state = self._published()
        if error is not None and state.get("error") != error:
            log.warning("publishing %s to %s: %s (writes go on; retrying)", self.index, self.url, error)
        if generation is not None:
            state.update(generation=generation, published_at=time.time())
        state["error"] = error
        state["attempt_at"] = time.time()
        write_json_atomic(self._state_path, state)

    def status(self) -> dict[str, Any]:
        """What /readyz reports: generations committed here but not yet on object storage."""
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


class Follower:
    """Keeps a local index directory at the newest generation published at `url` (a read replica).

    Each poll reads `LATEST`; a newer generation's pieces that the local copy lacks are fetched
    under the local writer lock (so a crash mid-fetch is undone by the next one's recovery, and
    two server workers never fetch at once), each checked against its sha256, and the generation
    record is committed last: readers never open a half-transferred generation. When the store
    cannot be reached the local copy keeps serving its last generation and reports itself stale.
    """

    def __init__(self, url: str, index: Path, interval_s: float = 2.0) -> None:
        self.where, self.url, self.index, self.interval_s = ObjectStoreUrl.parse(url), url, Path(index), interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._source_generation: int | None = None
        self._source_created = ""
        self._last_contact = 0.0
        self._last_error: str | None = None
        self._client: Any = None  # made at the first poll, then reused (boto3 clients are thread-safe)

    def start(self) -> "Follower":
        self._thread = threading.Thread(target=self._run, name="espn-follow", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception as exc:  # noqa: BLE001 - the store is away or a blob is bad: keep serving, retry
                with self._lock:
                    if self._last_error != str(exc):
                        log.warning("following %s: %s (still serving generation %d)", self.url, exc,
                                    read_current(self.index).number)
                    self._last_error = str(exc)
            self._stop.wait(self.interval_s)

    def poll_once(self) -> int | None:
        """Fetch and commit the newest published generation if it is newer; its number, or None."""
        from espn_indexing.live import IndexLockedError, LiveIndex

        client = self._client = self._client or _client()
        name = client.get_object(Bucket=self.where.bucket, Key=self.where.key("LATEST"))["Body"].read().decode().strip()
        record = json.loads(client.get_object(Bucket=self.where.bucket,
                                              Key=self.where.key(f"generations/{name}"))["Body"].read())
        remote = Generation.from_json(record["generation"])
        with self._lock:
            self._source_generation, self._source_created = remote.number, remote.created
            self._last_contact, self._last_error = time.monotonic(), None
        if remote.number <= read_current(self.index).number:
            return None
        writer = LiveIndex(self.index, side_indexes=[])
        try:
            with writer.locked(0.0) as current:
                if remote.number <= current.number:
                    return None
                for piece in record["pieces"]:
                    self._fetch(client, piece)
                writer.commit(remote)
        except IndexLockedError:
            return None  # another worker of this server is fetching it
        log.info("following %s: generation %d fetched and served", self.url, remote.number)
        return remote.number

    def _fetch(self, client: Any, piece: dict[str, Any]) -> None:
        target = self.index / piece["path"]
        start, stop = piece["start"], piece["stop"]
        appended = piece["path"].endswith("embeddings.bin")
        if target.exists():
            size = target.stat().st_size
            if appended and size >= stop:
                return  # fetched with an earlier generation (what lies past the published end is truncated on recovery)
            if not appended and size == stop - start and (not piece["path"].endswith("manifest.json")
                                                           or sha256_file(target) == piece["sha256"]):
                return  # immutable once written: the same path is the same bytes
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = target if appended else target.with_name(target.name + ".fetch.tmp")
        body = client.get_object(Bucket=self.where.bucket, Key=self.where.key(f"blobs/{piece['sha256']}"))["Body"]
        digest, size = hashlib.sha256(), 0
        with open(scratch, "r+b" if scratch.exists() else "wb") as f:
            f.seek(start if appended else 0)
            for chunk in body.iter_chunks(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        if size != stop - start or digest.hexdigest() != piece["sha256"]:
            if not appended:
                scratch.unlink(missing_ok=True)
            raise IndexCorruptError(f"{self.url}: blob {piece['sha256'][:12]}… of {piece['path']} does not match "
                                    "its sha256; the generation is not served")
        if not appended:
            os.replace(scratch, target)

    def status(self) -> dict[str, Any]:
        """What /readyz reports: the local and the source's generation, the lag, and staleness."""
        local = read_current(self.index)
        with self._lock:
            source, created, contact, error = (self._source_generation, self._source_created, self._last_contact,
                                               self._last_error)
        behind = max(0, (source or local.number) - local.number)
        lag_s = 0.0
        if behind and created:
            lag_s = max(0.0, time.time() - calendar.timegm(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ")))
        stale = contact == 0.0 or time.monotonic() - contact > 3 * self.interval_s + 5
        return {"source": self.url, "generation": local.number, "source_generation": source,
                "lag_generations": behind, "lag_seconds": round(lag_s, 1), "stale": stale, "last_error": error}


@dataclasses.dataclass(frozen=True)
class Retention:
    records_deleted: int
    blobs_deleted: int
    bytes_deleted: int


def apply_retention(url: str, keep: int, min_age_s: float = 3600.0) -> Retention:
    """Keep the newest `keep` generations on object storage and the blobs they need; delete the rest.

    Records go first (so no restore or follower starts on them), then the blobs no kept record
    names. A blob younger than `min_age_s` is kept whatever: a publish uploads its blobs before
    its record, and they must not vanish in between. A follower fetches the newest generation,
    which is always kept.
    """
    if keep < 1:
        raise InvalidParameterError(f"keep must be at least 1 (the newest generation), got {keep}")
    where, client = ObjectStoreUrl.parse(url), _client()

    def listing(folder: str) -> list[dict[str, Any]]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=where.bucket, Prefix=where.key(folder) + "/")
        return [obj for page in pages for obj in page.get("Contents", [])]

    records = sorted(listing("generations"), key=lambda o: o["Key"])
    kept, dropped = records[-keep:], records[:-keep]
    for obj in dropped:
        client.delete_object(Bucket=where.bucket, Key=obj["Key"])
    needed = {piece["sha256"] for obj in kept
              for piece in json.loads(client.get_object(Bucket=where.bucket, Key=obj["Key"])["Body"].read())["pieces"]}
    now = time.time()
    blobs = deleted_bytes = 0
    for obj in listing("blobs"):
        if obj["Key"].rsplit("/", 1)[-1] in needed or now - obj["LastModified"].timestamp() < min_age_s:
            continue
        client.delete_object(Bucket=where.bucket, Key=obj["Key"])
        blobs, deleted_bytes = blobs + 1, deleted_bytes + int(obj["Size"])
    log.info("%s: kept %d generations; deleted %d older records and %d blobs (%d bytes)", url, len(kept), len(dropped),
             blobs, deleted_bytes)
    return Retention(len(dropped), blobs, deleted_bytes)
