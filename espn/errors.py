"""Exceptions the library raises; the CLI and the server map them to exit codes and HTTP statuses."""

from __future__ import annotations

import errno
import os

__all__ = [
    "EspnError",
    "InvalidParameterError",
    "RefusedInputError",
    "TooLargeError",
    "ConflictError",
    "CorpusError",
    "IndexCorruptError",
    "IndexExistsError",
    "IndexNotFoundError",
    "UnavailableError",
    "NotEnabledError",
    "QueueFullError",
    "ShuttingDownError",
    "OverBudgetError",
    "WrongPartitionError",
    "DocumentNotFoundError",
    "BackendUnavailableError",
    "CorruptModelError",
    "IndexLockedError",
    "ReadOnlyIndexError",
    "WriteFailedError",
    "ObjectStoreError",
    "WriterUnavailableError",
    "WriterStandbyError",
    "WriterSupersededError",
    "SlotsMovingError",
    "StorageFullError",
    "PageMemoryBusyError",
    "storage_full",
    "UsageError",
]


class UsageError(Exception):
    """The command line itself is wrong (a missing or conflicting flag): exit status 2, as argparse gives.
    Here, not in espn.cli, so that commands registered into it (espn.live.commands) can raise it."""


class EspnError(Exception):
    """Base of every error the library raises on purpose.

    code: a machine-readable name of the case (e.g. `index_exists`) that entry points answer
    with; None: the entry point's name for the error's class."""

    code: str | None = None

    def __init__(self, *args: object, code: str | None = None) -> None:
        super().__init__(*args)
        if code is not None:
            self.code = code


class InvalidParameterError(EspnError, ValueError):
    """A caller passed a parameter outside its allowed range; the message names it and the range."""


class RefusedInputError(InvalidParameterError):
    """Input from outside the process (a body, a model directory, a snapshot, a remote answer)
    broke a stated rule of espn.untrusted (size, depth, path, file kind); the message names the
    object and the rule in one line."""


class TooLargeError(RefusedInputError):
    """Input that can never fit a memory bound of this process, however long it waited (a page
    whose decoded pixels are over the process's page memory). HTTP: 413."""


class ConflictError(InvalidParameterError):
    """A write that conflicts with itself (an id twice, an id both upserted and deleted) or with the
    index (a metadata field given another type than the index holds), or a name that is taken (a
    snapshot that exists or is being taken). HTTP: 409."""


class CorpusError(EspnError):
    """A corpus or query file cannot be read as asked; the message carries `file:line` where known."""


class IndexCorruptError(EspnError):
    """An index directory is missing a file, or a file does not match the manifest."""


class IndexExistsError(EspnError):
    """The output index exists and overwriting it was not requested."""


class IndexNotFoundError(EspnError):
    """No index of that name is held (never was, or it was deleted). HTTP: 404."""


class UnavailableError(EspnError):
    """The engine cannot take the request now (an index opening or closing, the queue full, a
    shutdown, over the memory budget); the same request may succeed after `retry_after_s`.
    HTTP: 503 with Retry-After."""

    code = "unavailable"

    def __init__(self, *args: object, code: str | None = None, retry_after_s: int = 1) -> None:
        super().__init__(*args, code=code)
        self.retry_after_s = retry_after_s


class NotEnabledError(EspnError):
    """A feature this process was not started with (snapshots without a snapshot directory). HTTP: 404."""


class QueueFullError(UnavailableError):
    """More queries are waiting than the engine queues; retry later."""

    code = "overloaded"


class ShuttingDownError(UnavailableError):
    """The engine is closing and takes no new work."""

    code = "shutting_down"


class OverBudgetError(InvalidParameterError):
    """A request over its work budget (candidates to score, or the answer's size). HTTP: 422."""

    code = "over_budget"


class WrongPartitionError(ConflictError):
    """A write holds an id another partition owns (a router or client with the wrong layout). HTTP: 421."""

    code = "wrong_partition"


class DocumentNotFoundError(EspnError, KeyError):
    """An external document id is not in the index."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain message.
        return str(self.args[0]) if self.args else "document not found"


class CorruptModelError(EspnError):
    """A model file is missing or does not hash to what it must (the default encoder's wheel)."""


class BackendUnavailableError(EspnError):
    """An optional backend (kvikio, CUDA) was requested but cannot be used here."""


class IndexLockedError(EspnError):
    """Another process holds the index's writer lock (one writer at a time)."""


class ReadOnlyIndexError(EspnError):
    """A write to an index that is served or mounted read-only."""


class WriteFailedError(EspnError):
    """A write could not be published (the disk is full, the writer queue is full, ...);
    nothing of it is visible and it may be retried."""


class ObjectStoreError(EspnError):
    """Object storage cannot be reached, or an object an index needs is missing or unreadable
    there; the message names the object (s3://BUCKET/KEY), what it was needed for, and the cause."""


class WriterUnavailableError(EspnError):
    """This server cannot acknowledge a write now, and nothing of the write was acknowledged;
    another server may (the partition's current writer) or this one soon. HTTP: 503."""


class WriterStandbyError(WriterUnavailableError):
    """This server stands by for a partition whose writer lease another process holds (or its own
    lease is not renewed): it serves searches, and writes go to the lease holder."""


class WriterSupersededError(WriterUnavailableError):
    """Another writer took this partition over (a newer epoch on object storage): this one stops
    acknowledging writes at once and becomes a follower. Nothing it did not publish was acknowledged."""


class SlotsMovingError(WriterUnavailableError):
    """A reshard is moving the id's hash slot to another partition: writes to it wait for the
    switch (seconds) and then go to the new owner."""


class StorageFullError(WriteFailedError):
    """The filesystem holding the index (or a snapshot) has no space left: what was being written
    is removed or never published, nothing acknowledged before is lost; free space and retry.
    HTTP: 507."""


class PageMemoryBusyError(WriteFailedError):
    """The decoded pages of other writes hold this process's page memory (espn.pages.memory) for
    longer than a write waits: nothing of it was kept, and it fits once they are done. HTTP: 503
    with Retry-After."""


# What a full disk says: the errno of an OSError, or the text of a native library that only
# hands back a message (Tantivy: "An IO error occurred: 'No space left on device (os error 28)'").
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_FULL_MESSAGES = tuple(os.strerror(code) for code in sorted(_FULL_ERRNOS))


def storage_full(exc: BaseException, what: str) -> StorageFullError | None:
    """`exc` as a StorageFullError naming `what` was being written, None when it is not a full
    disk. The one place that recognises one: library boundaries (the writer, the text engine,
    snapshots) call it where they catch an OSError or a native library's error."""
    if isinstance(exc, StorageFullError):
        return exc
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        where = f" ({exc.filename})" if exc.filename else ""
        return StorageFullError(f"no space left on device writing {what}{where}; nothing of it was kept, "
                                "free space and retry")
    if not isinstance(exc, OSError) and any(message in str(exc) for message in _FULL_MESSAGES):
        return StorageFullError(f"no space left on device writing {what} ({exc}); nothing of it was kept, "
                                "free space and retry")
    return None
