"""A servable index directory from a generation on object storage (`espn restore s3://...`), and
the fetch of one stored piece that a follower shares."""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import Any, Mapping

from espn.errors import IndexCorruptError, InvalidParameterError
from espn.files.checksums import sha256_file
from espn.files.durable import fsync_path
from espn.layout import inside_index
from ...generation.segments import open_view
from espn.untrusted import inside_root, open_regular

from ..snapshot import new_directory, write_generation_record
from .store import CHUNK_BYTES, ObjectStoreUrl, Piece, latest_name, make_client, naming_failures, read_record

__all__ = ["restore_from_store", "fetch_piece"]

log = logging.getLogger(__name__)


def restore_from_store(url: str, dest: Path, generation: int | None = None) -> int:
    """A servable index directory at `dest` (new) from a generation on object storage (the newest
    by default), every byte verified; returns the generation's number.

    The record is checked against the index layout before anything is fetched (a bad one
    writes nothing); each piece lands beside its target and is renamed into place only once
    its size and sha256 match. IndexCorruptError for a bad record or blob, ObjectStoreError
    for a missing one or a store that does not answer, both naming the object.
    """
    where, dest = ObjectStoreUrl.parse(url), Path(dest)
    client = make_client()
    name = f"gen-{generation:06d}.json" if generation is not None else latest_name(client, where)
    checked = read_record(client, where, name) if name is not None else None
    if checked is None:
        missing = where.url(f"generations/{name}" if name is not None else "LATEST")
        raise InvalidParameterError(f"{url}: no published generation there ({missing} does not exist)")
    published, pieces = checked
    what = where.url(f"generations/{name}")
    with new_directory(dest, "a restore") as staging:
        staging.mkdir(exist_ok=True)
        for piece in sorted(pieces, key=lambda p: p.start):  # a file's ranges in order: each appends to the last
            fetch_piece(client, where, staging, piece, what)
        for path in {piece.path for piece in pieces}:
            fsync_path(staging / path)
        write_generation_record(staging, published)
        open_view(staging, verify="full").close()
    log.info("%s: generation %d restored from %s", dest, published.number, url)
    return published.number


def fetch_piece(client: Any, where: ObjectStoreUrl, root: Path, piece: Piece, what: str,
                local: Mapping[str, str] | None = None) -> int:
    """Make `root / piece.path` hold the piece's bytes; the bytes fetched (0: already there).

    The blob lands in a scratch file beside its target and is renamed into place (or, for a
    range of embeddings.bin, appended past the file's end) only after its size and sha256
    match: an existing file is never overwritten by unverified bytes. `local`: sha256 -> path
    of whole files the index holds already (its current generation's); a piece with the same
    bytes is hard-linked from there instead of fetched (a rewritten base's encoder: stored once)."""
    target = inside_index(root, piece.path, what)
    try:
        info: os.stat_result | None = os.lstat(target)
    except FileNotFoundError:
        info = None
    if info is not None and not stat.S_ISREG(info.st_mode):
        if stat.S_ISDIR(info.st_mode):
            raise IndexCorruptError(f"{what}: piece {piece.path!r}: {target} is a directory here; the generation is "
                                    "not fetched")
        # A link (or a FIFO) where an index file belongs is never read or followed: it goes, the piece is fetched.
        log.warning("%s: not a regular file (%s); removed, its piece is fetched again", target,
                    "a symbolic link" if stat.S_ISLNK(info.st_mode) else "a special file")
        target.unlink()
        info = None
    if info is not None:
        size = info.st_size
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
        if not piece.appended and local and piece.sha256 in local and _link_local(root, local[piece.sha256], piece,
                                                                                  scratch):
            os.replace(scratch, target)
            return 0
        _download(client, where, piece, scratch, what)
        if piece.appended and info is not None:
            _append_from(scratch, target, piece)
        else:
            os.replace(scratch, target)
    finally:
        scratch.unlink(missing_ok=True)
    return piece.size


def _link_local(root: Path, path: str, piece: Piece, scratch: Path) -> bool:
    """Hard-link the local file `root / path` to `scratch` if it is a regular file inside `root`
    holding exactly the piece's bytes (size and sha256 checked); False where it is not or cannot be."""
    try:
        source = inside_root(root, path, "a local copy", error=IndexCorruptError)
        fd, info = open_regular(source, "a local copy", error=IndexCorruptError)
    except IndexCorruptError:
        return False
    try:
        if info.st_size != piece.size or sha256_file(source) != piece.sha256:
            return False
        try:
            os.link(source, scratch, follow_symlinks=False)
        except OSError:
            return False  # another filesystem, or none with links: fetched instead
        linked = os.lstat(scratch)
        if (linked.st_dev, linked.st_ino) != (info.st_dev, info.st_ino):
            scratch.unlink()
            return False
        return True
    finally:
        os.close(fd)


def _download(client: Any, where: ObjectStoreUrl, piece: Piece, scratch: Path, what: str) -> None:
    """The piece's blob into `scratch` (fsynced), or IndexCorruptError if its size or sha256 is not the record's."""
    blob = f"blobs/{piece.sha256}"
    digest, size = hashlib.sha256(), 0
    with naming_failures(f"{what}: piece {piece.path!r}: fetching {where.url(blob)}"), open(scratch, "wb") as f:
        body = client.get_object(Bucket=where.bucket, Key=where.key(blob))["Body"]
        for chunk in body.iter_chunks(CHUNK_BYTES):
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


def _append_from(scratch: Path, target: Path, piece: Piece) -> None:
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
