"""Generations on object storage (S3 and what speaks its API: MinIO, Ceph, GCS's interoperability):
the durable copy of an index, and what a new machine restores from. This module: the store's
layout, the S3 client wrapper (boto3, an optional extra) and the checked generation records;
publisher.py, restore.py, follower.py and retention.py use it.

Layout under `s3://BUCKET/PREFIX/`:

    blobs/<sha256>              every file a generation needs, by content (so a file shared by
                                many generations is stored once, and a retry re-uploads nothing)
    generations/gen-NNNNNN.json the generation record, plus where each of its files' bytes are
                                (written only where none is; with the epoch of its writer)
    LATEST                      the name of the newest published generation record (and, under a
                                leased writer, its epoch: `Latest`)
    LEASE                       the writer lease (espn.live.replication.lease)
    members/NAME.json           the partition's servers, for a router (espn.live.replication.cluster)

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

import contextlib
import dataclasses
import io
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator

from espn.errors import EspnError, IndexCorruptError, InvalidParameterError, ObjectStoreError
from espn.files.checksums import sha256_file
from espn.layout import check_generation_layout, check_index_path
from espn.generation.format import MAX_CURRENT_BYTES, MAX_RECORD_BYTES, RECORD_NAME, Generation, record_number
from espn.untrusted import load_json

__all__ = ["ObjectStoreUrl", "Piece", "is_store_url", "make_client", "failure_cause", "naming_failures",
           "object_exists", "read_object", "read_object_tagged", "put_if", "Latest", "read_latest",
           "latest_name", "read_record", "checked_record", "pieces_of", "RangeReader",
           "stored_blobs", "OncePerCause", "CHUNK_BYTES"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_MISSING = ("404", "NoSuchKey", "NotFound")
_HOLDER = re.compile(r"[A-Za-z0-9._:/@-]{0,200}\Z")


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
class Piece:
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


def make_client() -> Any:
    try:  # boto3 is an optional extra (espn[s3])
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


def failure_cause(exc: BaseException) -> str:
    """The cause of a store call's failure in words: S3's error code and message, or the exception."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and isinstance(response.get("Error"), dict):
        error = response["Error"]
        code, message = error.get("Code", "error"), error.get("Message")
        return f"{code} ({message})" if message and message != code else str(code)
    if type(exc).__name__ == "FlexibleChecksumError":
        return f"the store's checksum of the object does not match its bytes ({exc})"
    return f"{type(exc).__name__}: {exc}"


def is_missing(exc: BaseException) -> bool:
    response = getattr(exc, "response", None)
    return isinstance(response, dict) and response.get("Error", {}).get("Code") in _MISSING


def store_failures() -> tuple[type[BaseException], ...]:
    """What a boto3 call raises when the store refuses or cannot be reached (boto3 is an optional extra)."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError, Boto3Error)


@contextlib.contextmanager
def naming_failures(what: str) -> Iterator[None]:
    """Turn a store failure inside the block into ObjectStoreError("<what>: <cause>"): one line
    that names the object, never a bare `NoSuchKey` or a botocore traceback."""
    try:
        yield
    except EspnError:
        raise
    except store_failures() as exc:
        raise ObjectStoreError(f"{what}: {failure_cause(exc)}") from exc


def object_exists(client: Any, where: ObjectStoreUrl, name: str) -> bool:
    from botocore.exceptions import ClientError

    with naming_failures(f"checking {where.url(name)}"):
        try:
            client.head_object(Bucket=where.bucket, Key=where.key(name))
            return True
        except ClientError as exc:
            if is_missing(exc):
                return False
            raise


def read_object(client: Any, where: ObjectStoreUrl, name: str, max_bytes: int) -> bytes | None:
    """The object's bytes, None when it does not exist; an object of more than `max_bytes` is
    IndexCorruptError, found from its length before any byte is read (and never read past
    `max_bytes + 1` bytes, whatever the store says its length is)."""
    found = read_object_tagged(client, where, name, max_bytes)
    return None if found is None else found[0]


def read_object_tagged(client: Any, where: ObjectStoreUrl, name: str, max_bytes: int) -> tuple[bytes, str] | None:
    """`read_object`, with the object's ETag (what a conditional write of it names next)."""
    from botocore.exceptions import ClientError

    with naming_failures(f"reading {where.url(name)}"):
        try:
            response = client.get_object(Bucket=where.bucket, Key=where.key(name))
        except ClientError as exc:
            if is_missing(exc):
                return None
            raise
        body = response["Body"]
        try:
            length = response.get("ContentLength")
            data = b"" if isinstance(length, int) and length > max_bytes else bytes(body.read(max_bytes + 1))
        finally:
            body.close()  # the rest of a refused object is never downloaded
    if isinstance(length, int) and length > max_bytes:
        raise IndexCorruptError(f"{where.url(name)}: refused, {length} bytes (at most {max_bytes}); nothing was fetched")
    if len(data) > max_bytes:
        raise IndexCorruptError(f"{where.url(name)}: refused, over {max_bytes} bytes; nothing was fetched")
    return data, str(response.get("ETag", ""))


def put_if(client: Any, where: ObjectStoreUrl, name: str, body: bytes, *, if_match: str | None = None,
           if_absent: bool = False, content_type: str = "application/octet-stream") -> str | None:
    """Write `name` only if it still has ETag `if_match` (or, `if_absent`, does not exist): the new
    ETag, or None when the condition failed (someone else wrote it, or it went). Without either
    condition the write is unconditional. A store without conditional writes answers 501 and this
    raises ObjectStoreError: a fenced writer never falls back to writing blindly."""
    from botocore.exceptions import ClientError

    conditions: dict[str, str] = {}
    if if_match is not None:
        conditions["IfMatch"] = if_match
    if if_absent:
        conditions["IfNoneMatch"] = "*"
    with naming_failures(f"writing {where.url(name)}"):
        try:
            response = client.put_object(Bucket=where.bucket, Key=where.key(name), Body=body,
                                         ContentType=content_type, **conditions)
        except ClientError as exc:
            if conditions and _condition_failed(exc):
                return None
            raise
    return str(response.get("ETag", ""))


def _condition_failed(exc: BaseException) -> bool:
    """412 (the ETag moved, or the object exists), 409 (a concurrent conditional write won) or, for
    If-Match, 404 (the object is gone): another writer got there first."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    code = response.get("Error", {}).get("Code")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "ConditionalRequestConflict", *_MISSING) or status in (409, 412)


@dataclasses.dataclass(frozen=True)
class Latest:
    """What LATEST says: the newest published generation record, the writer epoch that published
    (or fenced) it, and the object's ETag, which the next conditional write names.

    The body is the record's name alone while no leased writer ever published (epoch 0, the
    format before writer leases), else `NAME\\nepoch E\\nholder H\\n`: a new epoch always
    changes the bytes, so it always changes the ETag (a store's ETag may be the bytes' MD5)."""

    name: str
    epoch: int = 0
    holder: str = ""
    etag: str = ""

    def body(self) -> bytes:
        if self.epoch == 0:
            return self.name.encode()
        return f"{self.name}\nepoch {self.epoch}\nholder {self.holder}\n".encode()

    @classmethod
    def parse(cls, body: bytes, etag: str, what: str) -> "Latest":
        lines = body.decode("utf-8", "replace").strip().splitlines() or [""]
        name, fields = lines[0].strip(), dict(line.partition(" ")[::2] for line in lines[1:])
        epoch = fields.get("epoch", "0")
        holder = fields.get("holder", "")
        if not RECORD_NAME.match(name) or not epoch.isdigit() or len(epoch) > 12 or not _HOLDER.match(holder):
            raise IndexCorruptError(f"{what}: names {name[:80]!r} (epoch {epoch[:20]!r}), not a generation record "
                                    "(gen-NNNNNN.json) and a writer epoch; nothing was fetched")
        return cls(name, int(epoch), holder, etag)


def read_latest(client: Any, where: ObjectStoreUrl) -> Latest | None:
    """LATEST, parsed and checked, with its ETag; None before the first publish."""
    found = read_object_tagged(client, where, "LATEST", MAX_CURRENT_BYTES)
    return None if found is None else Latest.parse(found[0], found[1], where.url("LATEST"))


def latest_name(client: Any, where: ObjectStoreUrl) -> str | None:
    """The record LATEST names (gen-NNNNNN.json sorts by number), or None before the first publish."""
    latest = read_latest(client, where)
    return None if latest is None else latest.name


def read_record(client: Any, where: ObjectStoreUrl, name: str) -> tuple[Generation, list[Piece]] | None:
    """The generation record generations/`name`, parsed and checked against the index layout
    (`checked_record`) before anything it names is fetched; None when it does not exist."""
    body = read_object(client, where, f"generations/{name}", MAX_RECORD_BYTES)
    if body is None:
        return None
    what = where.url(f"generations/{name}")
    # Its size is bounded above; its depth is checked before the parser sees it.
    record = load_json(body, what, max_bytes=MAX_RECORD_BYTES, error=IndexCorruptError)
    generation, pieces = checked_record(record, what)
    if record_number(name) not in (None, generation.number):
        raise IndexCorruptError(f"{what}: records generation {generation.number}, not the one its name says; "
                                "the generation is not fetched")
    return generation, pieces


def checked_record(record: Any, what: str) -> tuple[Generation, list[Piece]]:
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
            piece = Piece(path, int(obj["start"]), int(obj["stop"]), str(obj["sha256"]))
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


def pieces_of(index: Path, generation: Generation) -> list[Piece]:
    """Every stored piece of the generation (start/stop: bytes of the file)."""
    pieces = []
    base = "" if generation.base == "." else f"{generation.base}/"
    manifest = f"{base}manifest.json"
    for needed in generation.needed_files():
        if needed.path == manifest:
            continue
        start, stop = needed.range if needed.range is not None else (0, needed.bytes)
        assert needed.sha256 is not None  # only the manifest has none
        pieces.append(Piece(needed.path, start, stop, needed.sha256))
    for path in sorted({manifest, "manifest.json"}):  # the base's manifest (and the root's, which marks the index)
        pieces.append(Piece(path, 0, (index / path).stat().st_size, sha256_file(index / path)))
    return pieces


class RangeReader(io.RawIOBase):
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


def stored_blobs(client: Any, where: ObjectStoreUrl) -> set[str]:
    """The sha256 of every blob on the store: one listing (a request per 1,000 blobs)."""
    prefix = where.key("blobs/")
    with naming_failures(f"listing {where.url('blobs/')}"):
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=where.bucket, Prefix=prefix)
        return {obj["Key"][len(prefix):] for page in pages for obj in page.get("Contents", [])}


class OncePerCause:
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
