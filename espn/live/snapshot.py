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
directory), verified in full.

A name is claimed before any byte is copied: `NAME.partial` is created under an flock of the
destination's parent directory and stays flocked while it is built, so of two snapshots (or
restores) to the same name, in threads or processes, one builds and the other gets
ConflictError at once; a `NAME.partial` no live claim holds is a crash's leftover and is
removed. A full disk is a StorageFullError, with the partial copy removed and the name free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, Optional

from espn.errors import ConflictError, IndexCorruptError, InvalidParameterError, storage_full
from espn.files import fsync_path, sha256_file, write_json_atomic
from espn.layout import check_generation_layout
from espn.generations import CURRENT, LIVE_DIR, Generation, held_generation
from espn.segments import open_view

__all__ = ["SnapshotResult", "snapshot", "restore", "new_directory", "verify_copy", "write_generation_record"]

log = logging.getLogger(__name__)

_APPENDED = "embeddings.bin"  # the one file a writer changes in place (appends, truncation of a crash's tail)


@dataclasses.dataclass(frozen=True)
class SnapshotResult:
    generation: int
    files: int
    linked_bytes: int
    copied_bytes: int


def snapshot(index: Path, dest: Path) -> SnapshotResult:
    """A consistent point-in-time copy of the index's current generation at `dest` (new), verified
    in full before it appears. ConflictError: `dest` exists or is being taken; StorageFullError: the
    disk filled (nothing is left behind)."""
    index, dest = Path(index), Path(dest)
    if not (index / "manifest.json").is_file():
        raise InvalidParameterError(f"{index}: not an espn index (no manifest.json)")
    with new_directory(dest, "a snapshot", verify=verify_copy) as staging:
        with held_generation(index) as generation:
            result = _copy_generation(index, generation, staging)
    log.info("%s: generation %d copied to %s (%d files; %d bytes linked, %d copied)", index, result.generation,
             dest, result.files, result.linked_bytes, result.copied_bytes)
    return result


def verify_copy(directory: Path) -> None:
    """What `espn verify` checks: the current generation opens and every byte matches its sha256."""
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


def _claim(dest: Path, staging: Path, what: str) -> int:
    """Create `staging` and return an fd holding its flock; claims in one directory take turns
    (an flock of the directory), so creating and locking is one step to any other claimant."""
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
        return claim
    finally:
        os.close(parent)


def _locked(directory: Path) -> Optional[int]:
    """An fd holding an exclusive flock of `directory`, None when another holds it."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def restore(source: Path, dest: Path) -> SnapshotResult:
    """A servable index directory at `dest` (new) from a snapshot (or any index directory),
    every byte checked against the generation's sha256 before it appears (`snapshot` verifies)."""
    return snapshot(source, dest)


def _copy_generation(index: Path, generation: Generation, out: Path) -> SnapshotResult:
    # A snapshot being restored came from outside: nothing it names may lead out of `out`.
    check_generation_layout(generation, str(index / LIVE_DIR / generation.file_name))
    out.mkdir(parents=True, exist_ok=True)  # the claimed staging directory
    if generation.base != ".":  # the root's manifest marks the directory as an index (the base is below)
        shutil.copyfile(index / "manifest.json", out / "manifest.json")
    linked = copied = files = 0
    appended: dict[str, int] = {}  # path -> bytes to copy (its published length)
    for needed in generation.needed_files():
        if needed.path.endswith(_APPENDED):  # the build's bytes, then the deltas' ranges: its published length
            appended[needed.path] = generation.embeddings_bytes
            continue
        source, target = index / needed.path, out / needed.path
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if needed.path.endswith("manifest.json"):  # rewritten by rename, never in place: still copied, it is small
            shutil.copyfile(source, target)
            copied += target.stat().st_size
        elif _link(source, target):
            linked += needed.bytes
        else:
            shutil.copyfile(source, target)
            copied += needed.bytes
        _check(target, needed.bytes, needed.sha256)
        files += 1
    for path, length in appended.items():
        target = out / path
        target.parent.mkdir(parents=True, exist_ok=True)
        _copy_prefix(index / path, target, length)
        copied += length
        files += 1
    for needed in generation.needed_files():  # the appended file: the deltas' ranges and a small base, checked
        if needed.path.endswith(_APPENDED) and needed.sha256 and (needed.range is not None or needed.bytes < (64 << 20)):
            start, stop = needed.range or (0, needed.bytes)
            if sha256_file(out / needed.path, start, stop) != needed.sha256:
                raise IndexCorruptError(f"{index / needed.path}: bytes {start}-{stop} do not match the generation")
    write_generation_record(out, generation)
    return SnapshotResult(generation.number, files, linked, copied)


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


def _link(source: Path, target: Path) -> bool:
    try:
        os.link(source, target)
        return True
    except OSError as exc:
        if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            return False  # another filesystem, or one without hard links: copy
        raise


def _copy_prefix(source: Path, target: Path, length: int) -> None:
    with open(source, "rb") as src, open(target, "wb") as dst:
        if os.fstat(src.fileno()).st_size < length:
            raise IndexCorruptError(f"{source}: shorter than the {length} bytes the generation published")
        left, in_kernel = length, True
        while left > 0:  # in-kernel copy (reflinks where the filesystem has them)
            try:
                if in_kernel:
                    done = os.copy_file_range(src.fileno(), dst.fileno(), min(left, 1 << 30))
                else:
                    done = os.sendfile(dst.fileno(), src.fileno(), None, min(left, 1 << 30))
            except OSError as exc:
                if not in_kernel or exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                in_kernel = False  # across filesystems (or none of them supports it): sendfile
                continue
            if done == 0:
                raise IndexCorruptError(f"{source}: ended before byte {length}")
            left -= done
        dst.flush()
        os.fsync(dst.fileno())


def _check(path: Path, size: int, sha256: str | None) -> None:
    got = path.stat().st_size
    if size >= 0 and got != size:
        raise IndexCorruptError(f"{path}: {got} bytes, the generation says {size}")
    if sha256 is not None and size < (64 << 20) and sha256_file(path) != sha256:
        raise IndexCorruptError(f"{path}: checksum mismatch (corrupted)")
