"""Exceptions the library raises; the CLI and the server map them to exit codes and HTTP statuses."""

from __future__ import annotations

__all__ = [
    "EspnError",
    "InvalidParameterError",
    "ConflictError",
    "CorpusError",
    "IndexCorruptError",
    "IndexExistsError",
    "DocumentNotFoundError",
    "BackendUnavailableError",
    "CorruptModelError",
    "IndexLockedError",
    "ReadOnlyIndexError",
    "WriteFailedError",
    "ObjectStoreError",
]


class EspnError(Exception):
    """Base of every error the library raises on purpose."""


class InvalidParameterError(EspnError, ValueError):
    """A caller passed a parameter outside its allowed range; the message names it and the range."""


class ConflictError(InvalidParameterError):
    """A write that conflicts with itself (an id twice, an id both upserted and deleted) or with the
    index (a metadata field given another type than the index holds). HTTP: 409."""


class CorpusError(EspnError):
    """A corpus or query file cannot be read as asked; the message carries `file:line` where known."""


class IndexCorruptError(EspnError):
    """An index directory is missing a file, or a file does not match the manifest."""


class IndexExistsError(EspnError):
    """The output index exists and overwriting it was not requested."""


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
