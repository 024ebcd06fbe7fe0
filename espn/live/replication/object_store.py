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
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from espn.errors import EspnError, IndexCorruptError, InvalidParameterError, ObjectStoreError
from espn.index import fsync_path, sha256_file
from espn.layout import check_generation_layout, check_index_path, inside_index
from espn.segments import Generation, held_generation, read_current

from ..snapshot import new_directory, write_generation_record

__all__ = ["ObjectStoreUrl", "PublishResult", "Publisher", "Follower", "Retention", "publish", "restore_from_store",
           "apply_retention", "is_store_url"]

log = logging.getLogger(__name__)

_CHUNK = 8 << 20
_RECORD_NAME = re.compile(r"gen-\d{6}\.json\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_MISSING = ("404", "NoSuchKey", "NotFound")
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

    def url(self, name: str) -> str:
        """s3://BUCKET/KEY of `name`: how every message names an object."""
        return f"s3://{self.bucket}/{self.key(name)}"


@dataclasses.dataclass(frozen=True)
class PublishResult:
    generation: int
    uploaded: int
    uploaded_bytes: int
    already_there: int


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Bytes [start, stop) of the index file `path` (relative, checked against the layout), stored as blobs/<sha256>."""

    path: str
    start: int
    stop: int
    sha256: str

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def appended(self) -> bool:
        """embeddings.bin: the writer appends to it, so a generation stores it as ranges."""
        return self.path.rsplit("/", 1)[-1] == "embeddings.bin"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def is_store_url(value: str | os.PathLike[str]) -> bool:
    return str(value).startswith("s3://")


def _client() -> Any:
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise InvalidParameterError("object storage needs boto3: pip install 'espn[s3]'") from None
    retries = {"max_attempts": 5, "mode": "standard"}
    try:  # every byte is checked against the generation's sha256: the store's own checksum adds nothing, and
        # objects copied between buckets fail it (FlexibleChecksumError) though their bytes are right
        config = Config(retries=retries, response_checksum_validation="when_required")
    except TypeError:  # botocore before 1.36 validates no response checksums
        config = Config(retries=retries)
    return boto3.client("s3", config=config)


def _cause(exc: BaseException) -> str:
    """The cause of a store call's failure in words: S3's error code and message, or the exception."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and isinstance(response.get("Error"), dict):
        error = response["Error"]
        code, message = error.get("Code", "error"), error.get("Message")
        return f"{code} ({message})" if message and message != code else str(code)
    if type(exc).__name__ == "FlexibleChecksumError":
        return f"the store's checksum of the object does not match its bytes ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _is_missing(exc: BaseException) -> bool:
    response = getattr(exc, "response", None)
    return isinstance(response, dict) and response.get("Error", {}).get("Code") in _MISSING


def _store_failures() -> tuple[type[BaseException], ...]:
    """What a boto3 call raises when the store refuses or cannot be reached (boto3 is an optional extra)."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError, Boto3Error)


@contextlib.contextmanager
def _naming(what: str) -> Iterator[None]:
    """Turn a store failure inside the block into ObjectStoreError("<what>: <cause>"): one line
    that names the object, never a bare `NoSuchKey` or a botocore traceback."""
    try:
        yield
    except EspnError:
        raise
    except _store_failures() as exc:
        raise ObjectStoreError(f"{what}: {_cause(exc)}") from exc


def _exists(client: Any, where: ObjectStoreUrl, name: str) -> bool:
    from botocore.exceptions import ClientError

    with _naming(f"checking {where.url(name)}"):
        try:
            client.head_object(Bucket=where.bucket, Key=where.key(name))
            return True
        except ClientError as exc:
            if _is_missing(exc):
                return False
            raise


def _read(client: Any, where: ObjectStoreUrl, name: str) -> bytes | None:
    """The object's bytes, None when it does not exist."""
    from botocore.exceptions import ClientError

    with _naming(f"reading {where.url(name)}"):
        try:
            return bytes(client.get_object(Bucket=where.bucket, Key=where.key(name))["Body"].read())
        except ClientError as exc:
            if _is_missing(exc):
                return None
            raise


def _latest_name(client: Any, where: ObjectStoreUrl) -> str | None:
    """The record LATEST names (gen-NNNNNN.json sorts by number), or None before the first publish."""
    body = _read(client, where, "LATEST")
    if body is None:
        return None
    name = body.decode("utf-8", "replace").strip()
    if not _RECORD_NAME.match(name):
        raise IndexCorruptError(f"{where.url('LATEST')}: names {name[:80]!r}, not a generation record "
                                "(gen-NNNNNN.json); nothing was fetched")
    return name


def _read_record(client: Any, where: ObjectStoreUrl, name: str) -> tuple[Generation, list[_Piece]] | None:
    """The generation record generations/`name`, parsed and checked against the index layout
    (`_checked_record`) before anything it names is fetched; None when it does not exist."""
    body = _read(client, where, f"generations/{name}")
    if body is None:
        return None
    what = where.url(f"generations/{name}")
    try:
        record = json.loads(body)
    except ValueError as exc:
        raise IndexCorruptError(f"{what}: not valid JSON ({exc}); the generation is not fetched") from None
    return _checked_record(record, what)


def _checked_record(record: Any, what: str) -> tuple[Generation, list[_Piece]]:
    """The generation and its pieces, every piece name checked (espn.layout) and every piece
    one the generation needs, each with a sane byte range and sha256: IndexCorruptError naming
    `what` and the piece otherwise."""
    try:
        generation = Generation.from_json(record["generation"])
        raw = list(record["pieces"])
    except KeyError as exc:
        raise IndexCorruptError(f"{what}: not a generation record (it has no {exc.args[0]!r})") from None
    except (TypeError, ValueError, AttributeError, IndexError) as exc:
        raise IndexCorruptError(f"{what}: not a generation record ({type(exc).__name__}: {exc})") from None
    check_generation_layout(generation, what)
    needed = {file.path for file in generation.needed_files()} | {"manifest.json"}
    pieces = []
    for obj in raw:
        path = check_index_path(obj.get("path") if isinstance(obj, dict) else None, what)
        try:
            piece = _Piece(path, int(obj["start"]), int(obj["stop"]), str(obj["sha256"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise IndexCorruptError(f"{what}: piece {path!r} has no valid start, stop and sha256 ({exc})") from None
        if path not in needed:
            raise IndexCorruptError(f"{what}: refused, piece {path!r} is no file generation {generation.number} "
                                    "needs; nothing was written for it")
        if not 0 <= piece.start <= piece.stop or (piece.start and not piece.appended) \
                or not _SHA256.match(piece.sha256):
            raise IndexCorruptError(f"{what}: refused, piece {path!r} has bytes {piece.start}-{piece.stop} and "
                                    f"sha256 {piece.sha256[:80]!r}, not a byte range and a sha256")
        pieces.append(piece)
    lacking = needed - {piece.path for piece in pieces}
    if lacking:
        raise IndexCorruptError(f"{what}: generation {generation.number} needs {sorted(lacking)[0]!r} and the "
                                "record names no piece of it")
    return generation, pieces


def _pieces(index: Path, generation: Generation) -> list[_Piece]:
    """Every stored piece of the generation (start/stop: bytes of the file)."""
    pieces = []
    base = "" if generation.base == "." else f"{generation.base}/"
    manifest = f"{base}manifest.json"
    for needed in generation.needed_files():
        if needed.path == manifest:
            continue
        start, stop = needed.range if needed.range is not None else (0, needed.bytes)
        assert needed.sha256 is not None  # only the manifest has none
        pieces.append(_Piece(needed.path, start, stop, needed.sha256))
    for path in sorted({manifest, "manifest.json"}):  # the base's manifest (and the root's, which marks the index)
        pieces.append(_Piece(path, 0, (index / path).stat().st_size, sha256_file(index / path)))
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


def _stored_blobs(client: Any, where: ObjectStoreUrl) -> set[str]:
    """The sha256 of every blob on the store: one listing (a request per 1,000 blobs)."""
    prefix = where.key("blobs/")
    with _naming(f"listing {where.url('blobs/')}"):
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=where.bucket, Prefix=prefix)
        return {obj["Key"][len(prefix):] for page in pages for obj in page.get("Contents", [])}


def publish(index: Path, url: str, client: Any = None, stored: set[str] | None = None) -> PublishResult:
    """Upload the index's current generation (what is not stored yet), then its record, then LATEST.

    The record is written only once every blob it names is known to be on the store: found by
    a HEAD (or in `stored`), or uploaded by this call. `client`: a boto3 S3 client to reuse
    (one is made by default). `stored`: sha256s of blobs checked on the store lately (by a
    listing or a HEAD; not asked again; what this publish finds or uploads is added).
    """
    index, where = Path(index), ObjectStoreUrl.parse(url)
    if not (index / "manifest.json").is_file():
        raise InvalidParameterError(f"{index}: not an espn index (no manifest.json)")
    client = client or _client()
    known = stored if stored is not None else set()
    uploaded = uploaded_bytes = there = 0
    with held_generation(index) as generation:
        pieces = _pieces(index, generation)
        for piece in pieces:
            name = f"blobs/{piece.sha256}"
            if piece.sha256 in known or _exists(client, where, name):
                there += 1
                known.add(piece.sha256)
                continue
            path = index / piece.path
            if sha256_file(path, piece.start, piece.stop) != piece.sha256:
                raise IndexCorruptError(f"{path}: bytes {piece.start}-{piece.stop} do not match the generation's "
                                        "sha256; nothing of this generation was published")
            with _naming(f"uploading {path} to {where.url(name)}"), _RangeReader(path, piece.start, piece.stop) as body:
                client.upload_fileobj(body, where.bucket, where.key(name))  # streamed (multipart when large)
            uploaded, uploaded_bytes = uploaded + 1, uploaded_bytes + piece.size
            known.add(piece.sha256)
            _checkpoint("uploaded")
        record = {"generation": generation.to_json(), "pieces": [piece.to_json() for piece in pieces]}
        name = generation.file_name
        with _naming(f"writing {where.url(f'generations/{name}')}"):
            client.put_object(Bucket=where.bucket, Key=where.key(f"generations/{name}"),
                              Body=json.dumps(record).encode(), ContentType="application/json")
        newest = _latest_name(client, where)
        if newest is None or newest < name:  # never move LATEST back (a slower, older publish racing a newer one)
            with _naming(f"writing {where.url('LATEST')}"):
                client.put_object(Bucket=where.bucket, Key=where.key("LATEST"), Body=name.encode())
    log.info("%s: generation %d published to %s (%d blobs uploaded, %d bytes; %d already there)", index,
             generation.number, url, uploaded, uploaded_bytes, there)
    return PublishResult(generation.number, uploaded, uploaded_bytes, there)


def restore_from_store(url: str, dest: Path, generation: int | None = None) -> int:
    """A servable index directory at `dest` (new) from a generation on object storage (the newest
    by default), every byte verified; returns the generation's number.

    The record is checked against the index layout before anything is fetched (a bad one
    writes nothing); each piece lands beside its target and is renamed into place only once
    its size and sha256 match. IndexCorruptError for a bad record or blob, ObjectStoreError
    for a missing one or a store that does not answer, both naming the object.
    """
    where, dest = ObjectStoreUrl.parse(url), Path(dest)
    client = _client()
    name = f"gen-{generation:06d}.json" if generation is not None else _latest_name(client, where)
    checked = _read_record(client, where, name) if name is not None else None
    if checked is None:
        missing = where.url(f"generations/{name}" if name is not None else "LATEST")
        raise InvalidParameterError(f"{url}: no published generation there ({missing} does not exist)")
    published, pieces = checked
    what = where.url(f"generations/{name}")
    with new_directory(dest, "a restore") as staging:
        staging.mkdir(exist_ok=True)
        for piece in sorted(pieces, key=lambda p: p.start):  # a file's ranges in order: each appends to the last
            _fetch_piece(client, where, staging, piece, what)
        for path in {piece.path for piece in pieces}:
            fsync_path(staging / path)
        write_generation_record(staging, published)
        from espn.segments import open_view

        open_view(staging, verify="full").close()
    log.info("%s: generation %d restored from %s", dest, published.number, url)
    return published.number


def _fetch_piece(client: Any, where: ObjectStoreUrl, root: Path, piece: _Piece, what: str) -> int:
    """Make `root / piece.path` hold the piece's bytes; the bytes fetched (0: already there).

    The blob lands in a scratch file beside its target and is renamed into place (or, for a
    range of embeddings.bin, appended past the file's end) only after its size and sha256
    match: an existing file is never overwritten by unverified bytes."""
    target = inside_index(root, piece.path, what)
    if target.exists():
        size = target.stat().st_size
        if piece.appended and size >= piece.stop:
            return 0  # fetched with an earlier generation (what lies past the published end is truncated on recovery)
        if not piece.appended and size == piece.size and (not piece.path.endswith("manifest.json")
                                                          or sha256_file(target) == piece.sha256):
            return 0  # immutable once written: the same path is the same bytes
        if piece.appended and piece.start > size:
            raise IndexCorruptError(f"{what}: piece {piece.path!r} bytes {piece.start}-{piece.stop} start past the end "
                                    f"of the local {size}-byte file; the generation is not fetched")
    elif piece.appended and piece.start != 0:
        raise IndexCorruptError(f"{what}: piece {piece.path!r} bytes {piece.start}-{piece.stop}: the file's first "
                                "bytes are in no earlier piece; the generation is not fetched")
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f"{target.name}.{piece.sha256[:16]}.fetch.tmp")
    try:
        _download(client, where, piece, scratch, what)
        if piece.appended and target.exists():
            _append_from(scratch, target, piece)
        else:
            os.replace(scratch, target)
    finally:
        scratch.unlink(missing_ok=True)
    return piece.size


def _download(client: Any, where: ObjectStoreUrl, piece: _Piece, scratch: Path, what: str) -> None:
    """The piece's blob into `scratch` (fsynced), or IndexCorruptError if its size or sha256 is not the record's."""
    blob = f"blobs/{piece.sha256}"
    digest, size = hashlib.sha256(), 0
    with _naming(f"{what}: piece {piece.path!r}: fetching {where.url(blob)}"), open(scratch, "wb") as f:
        body = client.get_object(Bucket=where.bucket, Key=where.key(blob))["Body"]
        for chunk in body.iter_chunks(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            if size > piece.size:
                break  # longer than the record says: corrupt, and no need to read the rest
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    if size != piece.size or digest.hexdigest() != piece.sha256:
        raise IndexCorruptError(f"{what}: piece {piece.path!r}: blob {where.url(blob)} does not match its sha256 "
                                f"or its {piece.size} bytes (corrupted in the store); nothing was renamed into place")


def _append_from(scratch: Path, target: Path, piece: _Piece) -> None:
    """The bytes of a verified range past `target`'s end appended to it (what it holds already is never rewritten)."""
    with open(scratch, "rb") as src, open(target, "r+b") as dst:
        have = os.fstat(dst.fileno()).st_size
        offset, left = have - piece.start, piece.stop - have
        while left > 0:
            done = os.copy_file_range(src.fileno(), dst.fileno(), left, offset, have)
            if done == 0:
                raise IndexCorruptError(f"{scratch}: ended before byte {piece.stop - piece.start}")
            offset, have, left = offset + done, have + done, left - done
        os.fsync(dst.fileno())


class _OncePerCause:
    """Warnings for a loop that polls: each distinct problem is logged once, and again at most
    every `every_s` while it lasts (with how often it recurred); its end is logged once."""

    def __init__(self, logger: logging.Logger, every_s: float = 600.0) -> None:
        self._log, self.every_s = logger, every_s
        self._seen: dict[str, tuple[float, int]] = {}  # message -> (when last logged, times since)

    def warning(self, message: str) -> None:
        now = time.monotonic()
        logged, since = self._seen.get(message, (-1e18, 0))
        if now - logged >= self.every_s:
            repeated = f" (seen {since} more times since it was last logged)" if since else ""
            self._log.warning("%s%s", message, repeated)
            if len(self._seen) > 64:  # many distinct messages: forget the oldest rather than grow
                self._seen.clear()
            self._seen[message] = (now, 0)
        else:
            self._seen[message] = (logged, since + 1)

    def resolved(self, message: str) -> None:
        if self._seen:
            self._seen.clear()
            self._log.info("%s", message)


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
        self._warnings = _OncePerCause(log)
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
        error = str(exc) if isinstance(exc, EspnError) else _cause(exc)
        self._warnings.warning(f"publishing {self.index} to {self.url}: {error} (writes go on; retrying, "
                               f"{self.max_backoff_s:g} s apart at most)")
        try:
            self._record(error=error)
        except Exception as state_error:  # noqa: BLE001 - e.g. a full disk: still retry, say so once
            self._warnings.warning(f"publishing {self.index}: cannot record the state in {self._state_path}: "
                                   f"{_cause(state_error)}")

    def publish_once(self) -> int | None:
        """Publish the current generation if it is not published (or the store lost it); its number, or None."""
        current = read_current(self.index).number
        if self._stored is None or time.monotonic() - self._checked_at > self.verify_every_s:
            self._check_store()
        if current == self._published().get("generation") and not self._republish:
            return None
        self._client = self._client or _client()  # made once: a boto3 client costs tens of ms to make
        assert self._stored is not None  # set by _check_store
        result = publish(self.index, self.url, self._client, self._stored)
        self._republish = False
        self._record(generation=result.generation)
        if self.keep is not None and time.monotonic() - self._retained_at > self.RETENTION_EVERY_S:
            self._retained_at = time.monotonic()
            self._stored = None  # retention deletes blobs: list again before the next publish
            apply_retention(self.url, self.keep)
        return result.generation

    def _check_store(self) -> None:
        """List the store's blobs (what the next publish need not upload) and check that the
        published generation's record, its blobs and LATEST are all still there."""
        self._client = self._client or _client()
        stored = _stored_blobs(self._client, self.where)
        published = self._published().get("generation")
        problem = None
        if published is not None:
            name = f"gen-{int(published):06d}.json"
            checked = _read_record(self._client, self.where, name)
            latest = _latest_name(self._client, self.where)
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
                self._warnings.warning(f"publishing {self.index} to {self.url}: {problem}")
                self._record(error=problem, lost=True)
                self._republish = True
        self._stored, self._checked_at = stored, time.monotonic()

    def _published(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self._state_path.read_text()))
        except (OSError, ValueError):
            return {}

    def _record(self, generation: int | None = None, error: str | None = None, lost: bool = False) -> None:
        """live/PUBLISHED: the generation the store holds whole (None once it lost it), the last error."""
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

    def __init__(self, url: str, index: Path, interval_s: float = 2.0) -> None:
        self.where, self.url, self.index, self.interval_s = ObjectStoreUrl.parse(url), url, Path(index), interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._source_generation: int | None = None
        self._source_created = ""
        self._last_contact = 0.0
        self._last_error: str | None = None
        self._warnings = _OncePerCause(log)
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
                with self._lock:
                    self._last_error = None
                self._warnings.resolved(f"following {self.url}: fetching again")
            except Exception as exc:  # noqa: BLE001 - the store is away or what it holds is bad: keep serving, retry
                error = str(exc) if isinstance(exc, EspnError) else _cause(exc)
                with self._lock:
                    self._last_error = error
                with contextlib.suppress(Exception):
                    error = f"{error} (still serving generation {read_current(self.index).number})"
                self._warnings.warning(f"following {self.url}: {error}")
            self._stop.wait(self.interval_s)

    def poll_once(self) -> int | None:
        """Fetch and commit the newest published generation if it is newer; its number, or None."""
        from ..writer import IndexLockedError, LiveIndex

        client = self._client = self._client or _client()
        name = _latest_name(client, self.where)
        if name is not None:
            with self._lock:  # what the store says is newest, even when its record is then refused
                self._source_generation, self._source_created = int(name[4:10]), ""
                self._last_contact = time.monotonic()
        checked = _read_record(client, self.where, name) if name is not None else None
        if checked is None:
            raise ObjectStoreError(f"{self.url}: no published generation there "
                                   f"({self.where.url(f'generations/{name}' if name else 'LATEST')} does not exist)")
        remote, pieces = checked
        with self._lock:
            self._source_generation, self._source_created = remote.number, remote.created
        if remote.number <= read_current(self.index).number:
            return None
        what = self.where.url(f"generations/{name}")
        writer = LiveIndex(self.index, side_indexes=[])
        try:
            with writer.locked(0.0) as current:
                if remote.number <= current.number:
                    return None
                for piece in sorted(pieces, key=lambda p: p.start):  # a file's ranges in order
                    _fetch_piece(client, self.where, self.index, piece, what)
                writer.commit(remote)
        except IndexLockedError:
            return None  # another worker of this server is fetching it
        log.info("following %s: generation %d fetched and served", self.url, remote.number)
        return remote.number

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
        with _naming(f"listing {where.url(folder + '/')}"):
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=where.bucket,
                                                                     Prefix=where.key(folder) + "/")
            return [obj for page in pages for obj in page.get("Contents", [])]

    def delete(key: str) -> None:
        with _naming(f"deleting s3://{where.bucket}/{key}"):
            client.delete_object(Bucket=where.bucket, Key=key)

    records = sorted(listing("generations"), key=lambda o: o["Key"])
    kept, dropped = records[-keep:], records[:-keep]
    for obj in dropped:
        delete(obj["Key"])
    needed: set[str] = set()
    for obj in kept:  # a record that cannot be read stops retention before any blob is deleted
        checked = _read_record(client, where, obj["Key"].rsplit("/", 1)[-1])
        needed |= {piece.sha256 for piece in checked[1]} if checked is not None else set()
    now = time.time()
    blobs = deleted_bytes = 0
    for obj in listing("blobs"):
        if obj["Key"].rsplit("/", 1)[-1] in needed or now - obj["LastModified"].timestamp() < min_age_s:
            continue
        delete(obj["Key"])
        blobs, deleted_bytes = blobs + 1, deleted_bytes + int(obj["Size"])
    log.info("%s: kept %d generations; deleted %d older records and %d blobs (%d bytes)", url, len(kept), len(dropped),
             blobs, deleted_bytes)
    return Retention(len(dropped), blobs, deleted_bytes)
