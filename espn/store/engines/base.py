"""The read-engine contract: one call hands over every extent of a read; the engine keeps
them in flight and reports when all are done.

An engine moves bytes and nothing else: the posix reader plans the extents
(`plan_extents`), owns the file descriptors and the page-aligned destination buffer, and
parses the result. `submit` returns at once with the reads in flight; `EngineRead.wait`
blocks until every extent has finished. There is no Python work per extent on the
submitting side of the native engines (`io_uring`, `aio`): offsets and lengths go to
the kernel as numpy arrays.

Threads: an engine is shared by every thread of a process. Ring-based engines keep one
ring per submitting thread, so `wait` must run on the thread that called `submit`.

The ownership of the memory a read targets: `espn.store.engines.ownership`; errors and
retries: `errors` and `limits`; the test hook: `faults`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from ...errors import InvalidParameterError
from .limits import IoLimits

__all__ = ["EngineRead", "ReadEngine", "buffer_span", "check_extents", "realign"]


class EngineRead(abc.ABC):
    """Extents in flight."""

    @abc.abstractmethod
    def wait(self) -> np.ndarray:
        """Block until every extent is done; [m] int64 bytes read per extent.

        A count below the extent's length means the file ended there (the caller zero-fills
        the rest); any other short transfer is completed by the engine. Raises OSError (a
        ReadError naming the file and offset for a failed read) only after every extent
        has finished, so nothing writes into the buffer once `wait` has returned or raised,
        unless `drained` says otherwise (a read stuck past the time limit). Idempotent.
        """

    @property
    @abc.abstractmethod
    def drained(self) -> bool:
        """No extent is with the kernel or a worker, and none will be handed over again:
        nothing can write into the buffer any more."""

    def cancel(self) -> None:
        """Withdraw the extents not yet handed to the kernel (they fail with ECANCELED); the
        ones it has are reaped by `wait`, which must still be called. Idempotent."""


class ReadEngine(abc.ABC):
    """Reads extents of a file into slices of one buffer.

    name:   what users pass (`--io-engine`, `ESPN_IO_ENGINE`) and what `reader.engine` says
    depth:  how many extents it keeps in flight at once (queue depth, or threads)
    limits: retries, backoff and time limits (`IoLimits`)
    """

    name: ClassVar[str]

    def __init__(self, depth: int = 64, limits: IoLimits | None = None, **options: Any) -> None:
        if options:
            raise InvalidParameterError(f"unknown option(s) for the {self.name!r} engine: {', '.join(sorted(options))}")
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 4096:
            raise InvalidParameterError(f"io_depth must be an integer in [1, 4096], got {depth!r}")
        if limits is not None and not isinstance(limits, IoLimits):
            raise InvalidParameterError(f"limits must be an IoLimits, got {limits!r}")
        self.depth = depth
        self.limits = limits or IoLimits()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this engine cannot run on this host, or None. Cheap enough to call at open."""
        return None

    @abc.abstractmethod
    def submit(self, fd: int, file_offsets: np.ndarray, lengths: np.ndarray, buffer: np.ndarray,
               buffer_offsets: np.ndarray) -> EngineRead:
        """Start reading extent i (`lengths[i]` bytes at `file_offsets[i]` of `fd`) into
        `buffer[buffer_offsets[i]:][:lengths[i]]`; returns without waiting.

        file_offsets, lengths, buffer_offsets: [m] int64 (m >= 1); buffer: 1-D writable
        uint8, page-aligned where `fd` is opened with O_DIRECT. The caller keeps `buffer`
        alive and untouched until the read is drained. Raises StoreClosedError once the
        engine is closed, and nothing else once a read has started (its errors come from
        `wait`), except an exception such as KeyboardInterrupt, after draining.
        """

    def close(self) -> None:
        """Wait for (or cancel and reap) every read in flight, then release rings, contexts
        and threads; later submits raise StoreClosedError. Idempotent."""

    def when_idle(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the engine is closed and no read is in flight any more: at
        once, or from the thread whose reads drain last (the posix reader closes its file
        descriptor here, so that no read still queued can find its number reused)."""
        callback()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(depth={self.depth})"


def buffer_span(buffer: np.ndarray) -> tuple[int, int]:
    """(address, nbytes) of a 1-D uint8 numpy buffer, as the ledger keys it."""
    return int(buffer.__array_interface__["data"][0]), int(buffer.nbytes)


def check_extents(file_offsets: np.ndarray, lengths: np.ndarray, buffer: np.ndarray,
                  buffer_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate one submission (shapes, bounds) and return the arrays as int64."""
    file_offsets = np.asarray(file_offsets, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    buffer_offsets = np.asarray(buffer_offsets, dtype=np.int64)
    if not file_offsets.shape == lengths.shape == buffer_offsets.shape or file_offsets.ndim != 1:
        raise ValueError("file_offsets, lengths and buffer_offsets must be 1-D arrays of one length")
    if buffer.dtype != np.uint8 or buffer.ndim != 1 or not buffer.flags.writeable:
        raise ValueError("buffer must be a writable 1-D uint8 array")
    if len(lengths) and (lengths.min() < 0 or file_offsets.min() < 0 or buffer_offsets.min() < 0
                         or int((buffer_offsets + lengths).max()) > len(buffer)):
        raise ValueError("an extent falls outside the buffer or has a negative offset or length")
    return file_offsets, lengths, buffer_offsets


def realign(done: int, file_offset: int, address: int) -> int:
    """Where to resume a short read: `done` rounded down to the alignment the extent had.

    Under O_DIRECT the kernel wants offset, address and length aligned to the device's
    logical block; resuming from an unaligned count would be refused with EINVAL. The
    extent's own alignment (the lowest set bit of its offset and address, at most 4096)
    was accepted, so re-reading the aligned block that holds the remainder always is.
    """
    both = file_offset | address
    unit = min(4096, both & -both) if both else 4096
    return done - done % unit
