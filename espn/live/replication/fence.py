"""The commit point on object storage, fenced: how a generation becomes published.

A generation is published by three kinds of write, in order:
1. its blobs (content-addressed: writing one twice writes the same bytes);
2. its record, `generations/gen-NNNNNN.json`, only where no record is (`If-None-Match: *`), so
   a record is never overwritten; it carries the epoch of the writer that wrote it;
3. `LATEST`, only by a conditional write on the ETag the writer last read (`If-Match`), naming
   the record and the writer's epoch (espn.live.replication.store.Latest).

The third write is the commit point and the fence. A writer that takes a partition over
(espn.live.replication.lease) first rewrites LATEST under its new epoch (`fence_latest`): from
then on every older writer's conditional write of LATEST fails, whatever it last read, and a
writer that reads LATEST and finds a newer epoch knows it was superseded
(WriterSupersededError). A superseded writer may have written a record its LATEST write then
failed to name (an orphan, never acknowledged): the new writer finds that number taken and
publishes under the next free one (`publish_fenced` renumbers), never over it.

A write the store applied but whose answer was lost (boto3 retries it) fails its condition
the second time: each step then reads what is there, and what it meant to write counts as
written when the bytes are its own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Sequence

from espn.errors import IndexCorruptError, ObjectStoreError, WriterSupersededError
from espn.files.checksums import sha256_file
from espn.files.crash_points import checkpoint
from espn.generation.format import MAX_RECORD_BYTES, RECORD_NAME, Generation
from espn.untrusted import load_json

from .store import (Latest, ObjectStoreUrl, Piece, RangeReader, naming_failures, object_exists, pieces_of, put_if,
                    read_latest, read_object)

__all__ = ["FenceToken", "Published", "NumberTaken", "upload_pieces", "write_record", "advance_latest",
           "fence_latest", "publish_fenced", "UPLOAD_THREADS"]

log = logging.getLogger(__name__)

#: Blobs uploaded at once by one publish (a delta is some 10 to 20 small files; each is a PUT).
UPLOAD_THREADS = 8
#: Conditional writes of LATEST retried this many times while other writes of it win the race.
_LATEST_TRIES = 8
#: Times a publish takes the next free number when a superseded writer left a record in its way.
_RENUMBER_TRIES = 8


@dataclasses.dataclass(frozen=True)
class FenceToken:
    """The writer a publish speaks for: its lease's epoch and its holder id (espn.live.replication.lease)."""

    epoch: int
    holder: str


@dataclasses.dataclass(frozen=True)
class Published:
    """What a publish did: the generation as published (renumbered if a number was taken), the
    LATEST it wrote (its ETag is what the next publish names), and what it uploaded."""

    generation: Generation
    latest: Latest
    uploaded: int
    uploaded_bytes: int
    already_there: int


class NumberTaken(Exception):
    """A record other than this generation's holds its number (written under `epoch`)."""

    def __init__(self, number: int, epoch: int) -> None:
        super().__init__(f"generation record {number} exists (epoch {epoch})")
        self.number, self.epoch = number, epoch


def upload_pieces(client: Any, where: ObjectStoreUrl, index: Path, pieces: Sequence[Piece], known: set[str],
                  *, ask_store: bool = True) -> tuple[int, int, int]:
    """Every piece's blob onto the store; returns (uploaded, bytes uploaded, already there).

    `known`: sha256s of blobs known to be stored (from a listing, a HEAD or an upload; what this
    call uploads is added). `ask_store`: HEAD a blob not in `known` before uploading it (False
    where `known` comes from a recent listing and a new blob is all but certainly absent: a
    second upload of a blob writes the same bytes). Uploads run UPLOAD_THREADS at a time; each
    piece is checked against its sha256 before it goes."""
    missing = []
    there = 0
    for piece in {p.sha256: p for p in pieces}.values():  # a file stored twice in one generation goes once
        if piece.sha256 in known or (ask_store and object_exists(client, where, f"blobs/{piece.sha256}")):
            there += 1
            known.add(piece.sha256)
        else:
            missing.append(piece)

    def upload(piece: Piece) -> int:
        path, name = index / piece.path, f"blobs/{piece.sha256}"
        if sha256_file(path, piece.start, piece.stop) != piece.sha256:
            raise IndexCorruptError(f"{path}: bytes {piece.start}-{piece.stop} do not match the generation's "
                                    "sha256; nothing of this generation was published")
        with naming_failures(f"uploading {path} to {where.url(name)}"), RangeReader(path, piece.start, piece.stop) as body:
            client.upload_fileobj(body, where.bucket, where.key(name))  # streamed (multipart when large)
        checkpoint("uploaded")  # crash point: a writer killed mid-upload (tests/crash_serve.py)
        return piece.size

    if len(missing) <= 1:
        sizes = [upload(piece) for piece in missing]
    else:
        with concurrent.futures.ThreadPoolExecutor(min(UPLOAD_THREADS, len(missing)), "espn-upload") as pool:
            sizes = list(pool.map(upload, missing))  # the first failure is raised, after the others end
    known.update(piece.sha256 for piece in missing)
    return len(missing), sum(sizes), there


def _record_body(generation: Generation, pieces: Sequence[Piece], token: FenceToken | None) -> bytes:
    record: dict[str, Any] = {"generation": generation.to_json(), "pieces": [piece.to_json() for piece in pieces]}
    if token is not None:
        record.update(epoch=token.epoch, writer=token.holder)
    return json.dumps(record).encode()


def write_record(client: Any, where: ObjectStoreUrl, generation: Generation, pieces: Sequence[Piece],
                 token: FenceToken | None) -> None:
    """generations/gen-NNNNNN.json, written only where none is. A record already there that holds
    this very generation counts as written; another one is NumberTaken."""
    name = f"generations/{generation.file_name}"
    if put_if(client, where, name, _record_body(generation, pieces, token), if_absent=True,
              content_type="application/json") is not None:
        return
    body = read_object(client, where, name, MAX_RECORD_BYTES)
    if body is None:  # written and removed in between (retention): the number is not ours to reuse blindly
        raise NumberTaken(generation.number, 0)
    existing = load_json(body, where.url(name), max_bytes=MAX_RECORD_BYTES, error=IndexCorruptError)
    if isinstance(existing, dict) and existing.get("generation") == generation.to_json():
        return
    epoch = existing.get("epoch", 0) if isinstance(existing, dict) else 0
    raise NumberTaken(generation.number, epoch if isinstance(epoch, int) else 0)


def advance_latest(client: Any, where: ObjectStoreUrl, name: str, token: FenceToken | None,
                   known: Latest | None = None) -> Latest:
    """Make LATEST name `name` under the token's epoch, by a conditional write on `known` (what the
    writer last read or wrote; read first when None). Returns LATEST as it now stands.

    Without a token (`espn publish`, a publisher without a lease) LATEST never moves back, and a
    prefix a leased writer has published to is refused. With one, a newer epoch on the store is
    WriterSupersededError: nothing is written."""
    epoch, holder = (token.epoch, token.holder) if token is not None else (0, "")
    wanted = Latest(name, epoch, holder)
    seen = known
    for _ in range(_LATEST_TRIES):
        if seen is None:
            seen = read_latest(client, where)
        if seen is not None:
            _check_epoch(where, seen, token)
            if seen.name >= name and seen.epoch == epoch and (token is None or seen.holder == holder):
                return seen  # there already (our own write whose answer was lost), or past it
            if seen.name > name:
                raise ObjectStoreError(f"{where.url('LATEST')} names {seen.name}, newer than {name} that epoch "
                                       f"{epoch} is publishing; nothing was written")
        etag = put_if(client, where, "LATEST", wanted.body(), if_match=seen.etag if seen is not None else None,
                      if_absent=seen is None)
        if etag is not None:
            return dataclasses.replace(wanted, etag=etag)
        seen = None  # another write got there first: read what it wrote
    raise ObjectStoreError(f"{where.url('LATEST')}: changed under {_LATEST_TRIES} conditional writes in a row; "
                           "nothing was published (retried by the next publish)")


def _check_epoch(where: ObjectStoreUrl, seen: Latest, token: FenceToken | None) -> None:
    if token is None and seen.epoch > 0:
        raise ObjectStoreError(f"{where.url('LATEST')}: a leased writer publishes there (epoch {seen.epoch}, "
                               f"{seen.holder}); write through it (`espn serve --publish`), not `espn publish`")
    if token is not None and seen.epoch > token.epoch:
        raise WriterSupersededError(f"{where.url('LATEST')} is at epoch {seen.epoch} ({seen.holder}), past this "
                                    f"writer's {token.epoch}: another writer took the partition over")


def fence_latest(client: Any, where: ObjectStoreUrl, token: FenceToken) -> Latest | None:
    """LATEST rewritten under the token's epoch, naming what it names (None: nothing published
    yet, and the first publish's If-None-Match is the fence). After this no older epoch's
    conditional write of LATEST succeeds."""
    for _ in range(_LATEST_TRIES):
        seen = read_latest(client, where)
        if seen is None:
            return None
        _check_epoch(where, seen, token)
        if seen.epoch == token.epoch and seen.holder == token.holder:
            return seen
        etag = put_if(client, where, "LATEST", Latest(seen.name, token.epoch, token.holder).body(), if_match=seen.etag)
        if etag is not None:
            log.info("%s: fenced at %s under epoch %d", where.url("LATEST"), seen.name, token.epoch)
            return Latest(seen.name, token.epoch, token.holder, etag)
    raise ObjectStoreError(f"{where.url('LATEST')}: changed under {_LATEST_TRIES} conditional writes in a row; "
                           "the takeover is retried")


def highest_record(client: Any, where: ObjectStoreUrl) -> int:
    """The highest generation number with a record on the store (-1: none)."""
    prefix = where.key("generations/")
    with naming_failures(f"listing {where.url('generations/')}"):
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=where.bucket, Prefix=prefix)
        names = [obj["Key"][len(prefix):] for page in pages for obj in page.get("Contents", [])]
    numbers = [int(match[1]) for match in map(RECORD_NAME.match, names) if match is not None]
    return max(numbers, default=-1)


def publish_fenced(client: Any, where: ObjectStoreUrl, index: Path, generation: Generation, token: FenceToken,
                   known_blobs: set[str], latest: Latest | None, *, renumber: bool = True) -> Published:
    """Publish `generation` of `index` (its files written, not yet committed locally) under the token.

    Blobs, then the record, then LATEST by a conditional write on `latest`. A number a
    superseded writer's orphan record holds is skipped: the generation is published as the next
    free number (the caller commits it locally under that number). WriterSupersededError when a
    newer epoch holds the partition: nothing of this generation is named by LATEST. `renumber`
    False: the generation is committed here already, and a taken number is an error."""
    uploaded = uploaded_bytes = there = 0
    for _ in range(_RENUMBER_TRIES):
        pieces = pieces_of(index, generation)
        counts = upload_pieces(client, where, index, pieces, known_blobs, ask_store=False)
        uploaded, uploaded_bytes, there = uploaded + counts[0], uploaded_bytes + counts[1], counts[2]
        try:
            write_record(client, where, generation, pieces, token)
        except NumberTaken as taken:
            if taken.epoch >= token.epoch:
                raise WriterSupersededError(f"{where.url('generations/' + generation.file_name)} was written under "
                                            f"epoch {taken.epoch}, not this writer's {token.epoch}: another writer "
                                            "took the partition over") from None
            if not renumber:
                raise ObjectStoreError(f"{where.url('generations/' + generation.file_name)} holds another "
                                       f"generation (epoch {taken.epoch}); nothing was published") from None
            number = max(generation.number, highest_record(client, where)) + 1
            log.warning("%s: generation %d holds an orphan record of epoch %d (a superseded writer's); published as "
                        "%d", where.url("generations/"), generation.number, taken.epoch, number)
            generation = dataclasses.replace(generation, number=number)
            continue
        checkpoint("recorded")  # crash point: the record is written, LATEST does not name it yet
        written = advance_latest(client, where, generation.file_name, token, latest)
        return Published(generation, written, uploaded, uploaded_bytes, there)
    raise ObjectStoreError(f"{where.url('generations/')}: {_RENUMBER_TRIES} numbers in a row were taken; nothing "
                           "was published")
