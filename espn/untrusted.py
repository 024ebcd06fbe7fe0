"""What comes from outside the process, read as data: one rule, applied here once per mechanism.

A model directory, a snapshot, an object-store record, a partition's answer or a request body
is never executed; it is checked against a stated limit (bytes, depth, counts) before it is
parsed; a path from it resolves inside its root (a symbolic link is never followed out); only
regular files are read (a FIFO would hang a reader, `/dev/zero` would fill a disk); and a
refusal is one line naming the object and the rule it broke. Callers choose the exception
class (`error=`) so that each boundary keeps its own status: a corrupt snapshot is an
`IndexCorruptError`, a bad model directory a `CorruptModelError`, a request body a 400.

Like espn.files, this module imports nothing else of espn but its errors.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .errors import RefusedInputError

__all__ = ["RefusedInputError", "check_json_depth", "json_depth", "load_json", "read_bounded", "read_json_file",
           "open_regular", "regular_file", "inside_root", "regular_files_under", "MAX_JSON_DEPTH"]

# Deep enough for every document espn writes or reads (a manifest is about 5 levels, a search
# body with a filter about 8); far below the depth at which a recursive parser or validator
# runs out of stack (Python's json raises RecursionError near 1,000, pydantic sooner on some paths).
MAX_JSON_DEPTH = 64

# A JSON string, escapes included: removed before brackets are counted, so that "[[[" inside a
# string is text, not nesting. The regex engine does the scan in C.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# The step of each byte: +1 opens, -1 closes, 0 anything else (one table lookup per byte).
_STEP = np.zeros(256, dtype=np.int8)
_STEP[np.frombuffer(b"[{", dtype=np.uint8)] = 1
_STEP[np.frombuffer(b"]}", dtype=np.uint8)] = -1


def json_depth(data: bytes | str) -> int:
    """The deepest nesting of arrays and objects in JSON text, without parsing it (C-speed scans:
    a regex drops the strings, numpy counts the brackets). Malformed text gives some number;
    the parser that follows reports the malformation."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if b"[" not in raw and b"{" not in raw:
        return 0
    bare = np.frombuffer(_JSON_STRING.sub(b"", raw), dtype=np.uint8)
    return int(np.cumsum(_STEP[bare], dtype=np.int32).max(initial=0))


def check_json_depth(data: bytes | str, what: str, max_depth: int = MAX_JSON_DEPTH,
                     error: type[Exception] = RefusedInputError) -> None:
    """Raise `error` when `data` nests deeper than `max_depth` (checked before any parser sees it)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if raw.count(b"[") + raw.count(b"{") <= max_depth:  # cannot nest deeper than it opens
        return
    depth = json_depth(raw)
    if depth > max_depth:
        raise error(f"{what}: refused, JSON nested {depth} levels deep (at most {max_depth})")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: a number JSON allows that no float holds
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json(data: bytes | str, what: str, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH,
              error: type[Exception] = RefusedInputError, finite: bool = False) -> Any:
    """Parse JSON from outside after checking its size and depth; any failure is `error` in one line.

    finite: refuse NaN, Infinity and -Infinity (Python's extension, not JSON) and numbers past
    a float's range, so that every number parsed is finite (a score, a generation)."""
    size = len(data)
    if size > max_bytes:
        raise error(f"{what}: refused, {size} bytes (at most {max_bytes})")
    check_json_depth(data, what, max_depth, error)
    try:
        if finite:  # a Python call per float (about 0.3 us each)
            return json.loads(data, parse_float=_finite, parse_constant=_not_json)
        return json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise error(f"{what}: not valid JSON ({detail})") from None


def regular_file(path: Path, what: str, *, follow_links: bool = False,
                 error: type[Exception] = RefusedInputError) -> os.stat_result:
    """The stat of `path` if it is a regular file; a link (unless `follow_links`), a FIFO, a
    device, a socket or a directory is `error`."""
    try:
        info = os.stat(path) if follow_links else os.lstat(path)
    except FileNotFoundError:
        raise error(f"{what}: {path} does not exist") from None
    if stat.S_ISLNK(info.st_mode):
        raise error(f"{what}: refused, {path} is a symbolic link (links are not followed)")
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{what}: refused, {path} is {_kind(info.st_mode)}, not a regular file")
    return info


def read_bounded(path: Path, what: str, *, max_bytes: int, follow_links: bool = False,
                 error: type[Exception] = RefusedInputError) -> bytes:
    """The bytes of a regular file of at most `max_bytes`. Opened without following a final link
    and without blocking (a FIFO swapped in after a check cannot hang the read); the kind and
    size are checked on the open descriptor, and at most `max_bytes + 1` bytes are ever read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{what}: {path} does not exist") from None
    except OSError as exc:
        if os.path.islink(path) and not follow_links:
            raise error(f"{what}: refused, {path} is a symbolic link (links are not followed)") from None
        raise error(f"{what}: cannot open {path} ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{what}: refused, {path} is {_kind(info.st_mode)}, not a regular file")
        if info.st_size > max_bytes:
            raise error(f"{what}: refused, {path} is {info.st_size} bytes (at most {max_bytes})")
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:  # grew after the fstat
            raise error(f"{what}: refused, {path} is over {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_json_file(path: Path, what: str, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH,
                   follow_links: bool = False, error: type[Exception] = RefusedInputError) -> Any:
    """`load_json(read_bounded(path))`: a JSON file from outside, bounded before it is parsed."""
    data = read_bounded(path, what, max_bytes=max_bytes, follow_links=follow_links, error=error)
    return load_json(data, f"{what} ({path})", max_bytes=max_bytes, max_depth=max_depth, error=error)


def inside_root(root: Path, relative: str | Path, what: str, error: type[Exception] = RefusedInputError) -> Path:
    """`root / relative` when it is relative and, with every link resolved, stays inside `root`."""
    relative = Path(relative)
    if relative.is_absolute() or ".." in relative.parts:
        raise error(f"{what}: refused, {str(relative)!r} is not a plain relative path inside {root}")
    target = Path(root) / relative
    top, resolved = Path(root).resolve(), target.resolve()
    if resolved != top and top not in resolved.parents:
        raise error(f"{what}: refused, {str(relative)!r} resolves to {resolved}, outside {top}")
    return target


def regular_files_under(root: Path, what: str, *, max_files: int, max_bytes: int,
                        link_root: Path | None = None, error: type[Exception] = RefusedInputError,
                        skip: Callable[[Path], bool] | None = None) -> Iterator[tuple[Path, Path]]:
    """(relative path, real path) of every regular file under `root`, sorted, for a copy that must
    take data only. A symbolic link is taken as the file it names only when that file resolves
    inside `link_root` (default `root`): a Hugging Face cache snapshot links into its repository's
    `blobs/`, which a caller may allow; anything else, a link out, a FIFO or a device, is `error`.
    More than `max_files` files or `max_bytes` in all is `error` too. `skip(relative path)` true
    leaves a directory or file out unexamined (a checkpoint's `.git/`, other frameworks' exports)."""
    top = Path(root)
    allowed = Path(link_root if link_root is not None else root).resolve()
    count, total = 0, 0
    for directory, subdirs, files in os.walk(top, followlinks=False):
        if skip is not None:
            subdirs[:] = [name for name in subdirs if not skip(Path(directory, name).relative_to(top))]
            files = [name for name in files if not skip(Path(directory, name).relative_to(top))]
        subdirs.sort()
        for name in subdirs:
            if os.path.islink(os.path.join(directory, name)):
                raise error(f"{what}: refused, {Path(directory, name)} is a link to a directory (not followed)")
        for name in sorted(files):
            path = Path(directory, name)
            real = path.resolve() if path.is_symlink() else path
            if path.is_symlink() and real != allowed and allowed not in real.parents:
                raise error(f"{what}: refused, {path} links to {real}, outside {allowed}")
            info = regular_file(real, what, error=error)
            count += 1
            total += info.st_size
            if count > max_files:
                raise error(f"{what}: refused, more than {max_files} files under {top}")
            if total > max_bytes:
                raise error(f"{what}: refused, more than {max_bytes} bytes under {top}")
            yield path.relative_to(top), real


def open_regular(path: Path, what: str, *, error: type[Exception] = RefusedInputError) -> tuple[int, os.stat_result]:
    """(fd, its stat) of `path` opened read-only for a copy, as `read_bounded` opens: a final link
    is not followed and a FIFO cannot block the open; anything but a regular file is `error`
    (checked on the descriptor, so nothing swapped in after a check is read). The caller closes fd."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{what}: {path} does not exist") from None
    except OSError as exc:
        if os.path.islink(path):
            raise error(f"{what}: refused, {path} is a symbolic link (links are not followed)") from None
        raise error(f"{what}: cannot open {path} ({exc.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise error(f"{what}: refused, {path} is {_kind(info.st_mode)}, not a regular file")
    return fd, info


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"
