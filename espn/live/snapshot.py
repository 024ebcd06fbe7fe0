"""Snapshots and restores: a servable copy of one generation, taken while the index is served
and written.

A generation names every file and byte range it needs (`Generation.needed_files()`), and the
writer's garbage collector keeps them while a reader holds the generation: a snapshot holds
the current one, copies exactly those, then writes the generation record and `CURRENT` last,
so the copy is complete or absent (it is built beside its destination and renamed into
place). Immutable files are hard-linked where the filesystem allows (no bytes copied);
`embeddings.bin`, which the writer appends to (and whose unpublished tail its recovery
truncates), is always copied, up to the generation's published length. Every file is checked
against its size and sha256 as it lands, and the whole copy as `espn verify` checks an index
before it is renamed into place. A restore is the same copy from a snapshot (itself an index
directory), verified in full; the snapshot is data from outside (espn.untrusted): it restores
exactly the generation it pinned (`check_recorded`: no `live/CURRENT` beside a record is refused,
never read as generation 0) and only regular files inside it, of the sizes the record gives, are
read, linked or copied; a link, a FIFO, a device, a record or manifest too large or too deep is
refused in one line before any byte is copied.

A name is claimed before any byte is copied: `NAME.partial` is created under an flock of the
destination's parent directory and stays flocked while it is built, so of two snapshots (or
restores) to the same name, in threads or processes, one builds and the other gets
ConflictError at once. A `NAME.partial` no live claim holds is a killed copy's leftover: the
next claim in the same directory removes it (any name: each `NAME.partial` holds a marker file,
CLAIM_MARKER, until its rename), and `remove_leftovers` does it on demand. A full
disk is a StorageFullError, with the partial copy removed and the name free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from espn.errors import ConflictError, IndexCorruptError, InvalidParameterError, storage_full
from espn.files.checksums import sha256_file
from espn.files.crash_points import checkpoint
from espn.files.durable import fsync_path, write_json_atomic
from espn.layout import check_generation_layout
from espn.generation.format import (CURRENT, LIVE_DIR, MAX_RECORD_BYTES, Generation, check_recorded, held_generation,
                                     read_current)
from espn.generation.segments import open_view
from espn.untrusted import inside_root, load_json, open_regular, read_bounded

__all__ = ["SnapshotResult", "snapshot", "restore", "new_directory", "verify_copy", "write_generation_record",
           "default_name", "snapshots_in", "remove_leftovers", "CLAIM_MARKER"]

log = logging.getLogger(__name__)

_APPENDED = "embeddings.bin"  # the one file a writer changes in place (appends, truncation of a crash's tail)
#: A file in every `NAME.partial` being built (removed before the rename): what marks a
#: leftover as one of ours, so the next claim in the directory may remove it.
CLAIM_MARKER = ".espn-partial"


@dataclasses.dataclass(frozen=True)
class SnapshotResult:
    generation: int
    files: int
    linked_bytes: int
    copied_bytes: int


def default_name(prefix: str = "snapshot") -> str:
    """A snapshot name that no other default name takes: the UTC time to the millisecond and a
    random suffix of 32 bits (`snapshot-20261127T124801.123Z-3f9a0c1e`), so names sort by time
    and two taken in the same second (or millisecond, by two processes) differ."""
    now = time.time()
    return f"{prefix}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}.{int(now % 1 * 1000):03d}Z-{secrets.token_hex(4)}"


def snapshots_in(directory: Path) -> list[tuple[str, int]]:
    """(name, generation) of each complete snapshot in `directory`, by name (a copy still being
    taken, `*.partial`, is not one yet); none when the directory does not exist."""
    found = []
    for path in sorted(directory.glob("*")) if directory.is_dir() else []:
        if path.is_dir() and not path.name.endswith(".partial") and (path / "manifest.json").is_file():
            found.append((path.name, read_current(path).number))
    return found


def snapshot(index: Path, dest: Path) -> SnapshotResult:
    """A consistent point-in-time copy of the index's current generation at `dest` (new), verified
    in full before it appears. ConflictError: `dest` exists or is being taken; StorageFullError: the
    disk filled (nothing is left behind)."""
    return _copy(Path(index), Path(dest), "a snapshot", pinned=False)


def restore(source: Path, dest: Path) -> SnapshotResult:
    """A servable index directory at `dest` (new) from a snapshot (or any index directory),
    every byte checked against the generation's sha256 before it appears.

    The snapshot is data from outside: it restores exactly the generation it pinned or is
    refused in one line (IndexCorruptError): `live/CURRENT` missing beside a generation record
    (never generation 0 instead), a record or manifest too large or too deep, a file that is a
    link, a FIFO or a device, a path that resolves outside it, a size other than the record's."""
    return _copy(Path(source), Path(dest), "a restore", pinned=True)


def _copy(index: Path, dest: Path, what: str, pinned: bool) -> SnapshotResult:
    manifest = index / "manifest.json"
    if not os.path.lexists(manifest):
        raise InvalidParameterError(f"{index}: not an espn index (no manifest.json)")
    _read_manifest_bytes(index, "manifest.json")  # bounded and regular before anything parses it
    recorded = check_recorded(index) if pinned else None
    with new_directory(dest, what, verify=verify_copy) as staging:
        with held_generation(index) as generation:
            if recorded is not None and generation.number != recorded.number:
                raise IndexCorruptError(f"{index}: its current generation changed from {recorded.number} to "
                                        f"{generation.number} while it was restored (a snapshot does not change)")
            result = _copy_generation(index, generation, staging)
    log.info("%s: generation %d copied to %s (%d files; %d bytes linked, %d copied)", index, result.generation,
             dest, result.files, result.linked_bytes, result.copied_bytes)
    return result


def verify_copy(directory: Path) -> None:
    """What `espn verify` checks: the current generation opens and every byte matches its sha256."""
    check_recorded(directory)
    open_view(directory, verify="full").close()


@contextlib.contextmanager
def new_directory(dest: Path, what: str, verify: Optional[Callable[[Path], None]] = None) -> Iterator[Path]:
    """A directory built beside `dest` (claimed at once, see the module doc) and renamed into place
    (fsynced) when the block succeeds and `verify` passes on it; removed when either fails, the name
    then free again: `dest` is whole or absent."""
    dest = Path(dest)
    staging = dest.with_name(dest.name + ".partial")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        claim = _claim(dest, staging, what)
    except OSError as exc:
        raise storage_full(exc, f"{what} to {dest}") or exc
    try:
        yield staging
        if verify is not None:
            verify(staging)
        (staging / CLAIM_MARKER).unlink()
        fsync_path(staging)
        os.rename(staging, dest)
        fsync_path(dest.parent)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        full = storage_full(exc, f"{what} to {dest}")
        if full is not None:
            raise full from exc
        raise
    finally:
        os.close(claim)


def remove_leftovers(directory: Path) -> list[str]:
    """Remove what killed snapshots and restores left in `directory`: every `NAME.partial` that
    no live claim holds and that is ours (it holds CLAIM_MARKER, or nothing: killed right after
    its mkdir). Returns the names removed. Each claim makes the same sweep."""
    directory = Path(directory)
    try:
        parent = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return []
    try:
        fcntl.flock(parent, fcntl.LOCK_EX)
        return _remove_leftovers(directory)
    finally:
        os.close(parent)


def _remove_leftovers(directory: Path) -> list[str]:
    """remove_leftovers under the directory's flock (no claim is made meanwhile)."""
    removed = []
    for entry in os.scandir(directory):
        if not entry.name.endswith(".partial") or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        held = _locked(path)
        if held is None:
            continue  # being built
        try:
            names = os.listdir(path)
            if names and CLAIM_MARKER not in names:
                continue  # not ours: left alone
            shutil.rmtree(path)  # never follows a link inside it
        except OSError as exc:
            log.warning("%s: cannot remove a killed copy's leftover: %s", path, exc)
            continue
        finally:
            os.close(held)
        removed.append(entry.name)
        log.info("%s: removed a killed snapshot's or restore's leftover", path)
    return removed


def _claim(dest: Path, staging: Path, what: str) -> int:
    """Create `staging` and return an fd holding its flock; claims in one directory take turns
    (an flock of the directory), so creating and locking is one step to any other claimant.
    Leftovers of killed claims in the directory are removed first."""
    parent = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(parent, fcntl.LOCK_EX)  # held for a few syscalls, never during a copy
        if dest.exists():
            raise ConflictError(f"{dest}: already exists; {what} goes to a new directory")
        try:
            os.mkdir(staging)
        except FileExistsError:
            leftover = _locked(staging)
            if leftover is None:
                raise ConflictError(f"{dest}: {what} of this name is being taken (by another request or "
                                    "process); choose another name or retry when it is done") from None
            os.close(leftover)  # nobody holds it: a crashed copy's leftover
            shutil.rmtree(staging)
            os.mkdir(staging)
        claim = _locked(staging)
        assert claim is not None, "a directory created under the parent's lock is locked by nobody else"
        try:
            (staging / CLAIM_MARKER).write_bytes(b"")
            _remove_leftovers(dest.parent)  # ours is locked: kept
        except BaseException:
            os.close(claim)
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return claim
    finally:
        os.close(parent)


def _locked(directory: Path) -> Optional[int]:
    """An fd holding an exclusive flock of `directory`, None when another holds it."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _copy_generation(index: Path, generation: Generation, out: Path) -> SnapshotResult:
    # A snapshot being restored came from outside: nothing it names may lead out of `out`, and
    # nothing in it is read but regular files inside it, of the sizes the generation records.
    what = str(index / (f"{LIVE_DIR}/{generation.file_name}" if generation.number else "manifest.json"))
    check_generation_layout(generation, what)
    out.mkdir(parents=True, exist_ok=True)  # the claimed staging directory
    if generation.base != ".":  # the root's manifest marks the directory as an index (the base is below)
        (out / "manifest.json").write_bytes(_read_manifest_bytes(index, "manifest.json"))
    linked = copied = files = 0
    appended: dict[str, int] = {}  # path -> bytes to copy (its published length)
    for needed in generation.needed_files():
        if needed.path.endswith(_APPENDED):  # the build's bytes, then the deltas' ranges: its published length
            appended[needed.path] = generation.embeddings_bytes
            continue
        target = out / needed.path
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if needed.path.endswith("manifest.json"):  # rewritten by rename, never in place: copied, it is small
            data = _read_manifest_bytes(index, needed.path)
            target.write_bytes(data)
            copied += len(data)
        else:
            fd, info = _open_source(index, needed.path, what)
            try:
                if info.st_size != needed.bytes:
                    raise IndexCorruptError(f"{what}: refused, {index / needed.path} is {info.st_size} bytes, "
                                            f"the generation says {needed.bytes}")
                if _link(index / needed.path, target, info):
                    linked += needed.bytes
                else:
                    _copy_from(fd, index / needed.path, target, needed.bytes)
                    copied += needed.bytes
            finally:
                os.close(fd)
        _check(target, needed.bytes, needed.sha256)
        files += 1
        checkpoint("snapshot-copied")  # crash point: a copy killed midway (tests/test_snapshot_trust.py)
    for path, length in appended.items():
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, info = _open_source(index, path, what)
        try:
            if info.st_size < length:
                raise IndexCorruptError(f"{what}: refused, {index / path} is {info.st_size} bytes, shorter than the "
                                        f"{length} the generation published")
            _copy_from(fd, index / path, target, length)
        finally:
            os.close(fd)
        copied += length
        files += 1
        checkpoint("snapshot-copied")
    for needed in generation.needed_files():  # the appended file: the deltas' ranges and a small base, checked
        if needed.path.endswith(_APPENDED) and needed.sha256 and (needed.range is not None or needed.bytes < (64 << 20)):
            start, stop = needed.range or (0, needed.bytes)
            if sha256_file(out / needed.path, start, stop) != needed.sha256:
                raise IndexCorruptError(f"{index / needed.path}: bytes {start}-{stop} do not match the generation")
    write_generation_record(out, generation)
    return SnapshotResult(generation.number, files, linked, copied)


def _open_source(index: Path, path: str, what: str) -> tuple[int, os.stat_result]:
    """A file the generation needs, opened for a copy: inside `index` once every link is resolved,
    itself no link, a regular file (a FIFO or a device is refused at once, never read)."""
    source = inside_root(index, path, what, error=IndexCorruptError)
    return open_regular(source, what, error=IndexCorruptError)


def _read_manifest_bytes(index: Path, path: str) -> bytes:
    """The bytes of a manifest.json of `index`, refused unless a regular file inside it of at most
    MAX_RECORD_BYTES whose JSON nests at most MAX_JSON_DEPTH levels (checked before any parser)."""
    source = inside_root(index, path, str(index / path), error=IndexCorruptError)
    data = read_bounded(source, str(source), max_bytes=MAX_RECORD_BYTES, error=IndexCorruptError)
    load_json(data, str(source), max_bytes=MAX_RECORD_BYTES, error=IndexCorruptError)
    return data


def write_generation_record(out: Path, generation: Generation) -> None:
    """The last step of a copy: the generation record and `live/CURRENT` naming it (none for
    generation 0, which is the root's own manifest)."""
    if generation.number == 0:
        return
    live = out / LIVE_DIR
    live.mkdir(exist_ok=True)
    write_json_atomic(live / generation.file_name, generation.to_json())
    (live / CURRENT).write_text(generation.file_name + "\n")
    fsync_path(live / CURRENT)
    fsync_path(live)


def _link(source: Path, target: Path, opened: os.stat_result) -> bool:
    """Hard-link `source` (never a link it may have become: linkat without following) and check
    that what was linked is the file opened and checked; False where the filesystem cannot link."""
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            return False  # another filesystem, or one without hard links: copy
        raise
    linked = os.lstat(target)
    if (linked.st_dev, linked.st_ino) != (opened.st_dev, opened.st_ino) or not stat.S_ISREG(linked.st_mode):
        target.unlink()
        raise IndexCorruptError(f"{source}: refused, it was replaced while it was copied")
    return True


def _copy_from(src: int, source: Path, target: Path, length: int) -> None:
    """The first `length` bytes of the open file `src` into `target` (new), fsynced."""
    with open(target, "wb") as dst:
        left, offset, in_kernel = length, 0, True
        while left > 0:  # in-kernel copy (reflinks where the filesystem has them)
            try:
                if in_kernel:
                    done = os.copy_file_range(src, dst.fileno(), min(left, 1 << 30), offset)
                else:
                    done = os.sendfile(dst.fileno(), src, offset, min(left, 1 << 30))
            except OSError as exc:
                if not in_kernel or exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                in_kernel = False  # across filesystems (or none of them supports it): sendfile
                continue
            if done == 0:
                raise IndexCorruptError(f"{source}: ended before byte {length}")
            left, offset = left - done, offset + done
        dst.flush()
        os.fsync(dst.fileno())


def _check(path: Path, size: int, sha256: str | None) -> None:
    got = path.stat().st_size
    if size >= 0 and got != size:
        raise IndexCorruptError(f"{path}: {got} bytes, the generation says {size}")
    if sha256 is not None and size < (64 << 20) and sha256_file(path) != sha256:
        raise IndexCorruptError(f"{path}: checksum mismatch (corrupted)")
