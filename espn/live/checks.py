"""What a write is, and the checks it passes before anything is encoded or written."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from espn.errors import ConflictError, InvalidParameterError
from espn.ids import check_doc_id
from espn.pages.decode import MAX_IMAGE_BYTES
from espn.metadata import DEFAULT_LIMITS, MetadataLimits, check_field_count, check_metadata, merge_types, value_type

__all__ = ["NewDocument", "WriteRequest", "WriteResult", "WriteLimits", "check_write", "MAX_TEXT_CHARS"]

#: Longest passage (title and text, characters) a write accepts.
MAX_TEXT_CHARS = 100_000


@dataclasses.dataclass(frozen=True)
class NewDocument:
    """A document to upsert; metadata is stored with the passage (a JSON object).

    image: for an index of pages, the page as PNG, JPEG or WebP bytes (decoded within
    espn.pages.decode's bounds, encoded by the index's visual encoder, kept as espn.pages.images
    stores pages); text and title are then optional and describe it.
    """

    doc_id: str
    text: str = ""
    title: str = ""
    metadata: Mapping[str, Any] | None = None
    image: bytes | None = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass(frozen=True)
class WriteResult:
    """What a publish did: created / replaced / deleted external ids, the new generation."""

    generation: int
    created: list[str] = dataclasses.field(default_factory=list)
    replaced: list[str] = dataclasses.field(default_factory=list)
    deleted: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class WriteLimits:
    """What one write may hold (checked before anything is encoded or written)."""

    metadata: MetadataLimits = DEFAULT_LIMITS
    max_text_chars: int = MAX_TEXT_CHARS


@dataclasses.dataclass(frozen=True)
class WriteRequest:
    """One caller's write, checked: the ids it upserts (in order) and deletes, and the metadata
    fields its documents carry (name -> type). Published whole or not at all."""

    upserts: tuple[str, ...]
    deletes: tuple[str, ...]
    fields: Mapping[str, str] = dataclasses.field(default_factory=dict)


def check_write(upserts: Sequence[NewDocument], deletes: Sequence[str], limits: WriteLimits = WriteLimits()) -> WriteRequest:
    """Validate a write before anything is encoded or written; InvalidParameterError naming
    the document and the problem (ids: espn.ids; text length; metadata and its limits)."""
    if not upserts and not deletes:
        raise InvalidParameterError("nothing to write: give documents to upsert or ids to delete")
    seen: set[str] = set()
    fields: dict[str, str] = {}
    for i, d in enumerate(upserts):
        check_doc_id(d.doc_id, f"document {i}: id")
        if d.doc_id in seen:
            raise ConflictError(f"document id {d.doc_id!r} appears twice in one write")
        seen.add(d.doc_id)
        _check_document(d, limits, fields)
    for doc_id in deletes:
        check_doc_id(doc_id, "id to delete")
    if len(set(deletes)) != len(deletes):
        raise ConflictError("delete lists an id twice")
    both = seen.intersection(deletes)
    if both:
        raise ConflictError(f"id {sorted(both)[0]!r} is both upserted and deleted in one write")
    return WriteRequest(tuple(d.doc_id for d in upserts), tuple(deletes), fields)


def _check_document(d: NewDocument, limits: WriteLimits, fields: dict[str, str]) -> None:
    """Text and metadata of one document; its metadata fields' types merged into `fields`."""
    if not isinstance(d.text, str) or not isinstance(d.title, str):
        raise InvalidParameterError(f"document {d.doc_id!r}: title and text must be strings")
    if d.image is not None:
        if not isinstance(d.image, (bytes, bytearray, memoryview)) or not len(d.image):
            raise InvalidParameterError(f"document {d.doc_id!r}: image must be the page's PNG, JPEG or WebP bytes")
        if len(d.image) > MAX_IMAGE_BYTES:
            raise InvalidParameterError(f"document {d.doc_id!r}: image holds {len(d.image)} bytes; at most "
                                        f"{MAX_IMAGE_BYTES}")
    elif not (d.text.strip() or d.title.strip()):
        raise InvalidParameterError(f"document {d.doc_id!r}: text is empty")
    if len(d.text) + len(d.title) > limits.max_text_chars:
        raise InvalidParameterError(f"document {d.doc_id!r}: title and text hold {len(d.text) + len(d.title)} "
                                    f"characters; at most {limits.max_text_chars}")
    try:
        metadata = check_metadata(d.metadata if d.metadata is None else dict(d.metadata), limits.metadata)
        for name, value in metadata.items():
            kind = merge_types(fields.get(name), value_type(value))
            if kind is not None:
                fields[name] = kind
        check_field_count(fields, limits.metadata)
    except ValueError as exc:
        raise InvalidParameterError(f"document {d.doc_id!r}: {exc}") from None
