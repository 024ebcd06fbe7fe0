"""Resolving a group of writes against the current generation, in order, before anything is written.

Each write sees the ones before it in its group; one that cannot apply (an unknown id to
delete, a metadata field of another type than the index holds) fails alone.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import numpy as np

from espn.errors import ConflictError, DocumentNotFoundError, InvalidParameterError
from espn.index import IdMap, IndexDirectory, read_manifest
from espn.metadata import check_field_count, merge_types
from ..generation.format import LIVE_DIR, Generation, generation_schema, read_tombstones

from .checks import WriteLimits, WriteRequest
from .encoding import EncodedDocuments

__all__ = ["IndexState", "Resolved", "resolve_writes", "gather_kept"]

class IndexState:
    """What a writer needs of the current generation to resolve ids: every segment's id map
    (memory-mapped, holding no descriptor) and the tombstones; rebuilt per generation,
    sharing the unchanged maps with the one before."""

    def __init__(self, root: Path, generation: Generation, previous: "IndexState | None") -> None:
        self.generation = generation
        reuse = previous if previous is not None and previous.generation.base == generation.base else None
        self.base: IndexDirectory = reuse.base if reuse is not None else \
            IndexDirectory(root / generation.base, read_manifest(root / generation.base))
        maps = {} if reuse is None else reuse.maps
        self.maps: dict[str, IdMap] = {".": maps.get(".") or IdMap(self.base.load_array("ids.npy"),
                                                                   self.base.load_array("ids_sorted.npy"))}
        for info in generation.segments:
            seg = IndexDirectory(root / LIVE_DIR / info.name, {})
            self.maps[info.name] = maps.get(info.name) or IdMap(seg.load_array("ids.npy"),
                                                                seg.load_array("ids_sorted.npy"))
        self.firsts = [(0, ".")] + [(info.first, info.name) for info in generation.segments]
        self.tombstones = read_tombstones(root, generation)
        self.schema = generation_schema(self.base, generation)

    def live_number(self, doc_id: str) -> int | None:
        """The doc number of the live version of `doc_id`, None when it is absent or deleted."""
        for first, name in reversed(self.firsts):  # the newest version is the only one that can be live
            try:
                number = first + self.maps[name].internal(doc_id)
            except DocumentNotFoundError:
                continue
            at = int(np.searchsorted(self.tombstones, number))
            return None if at < len(self.tombstones) and self.tombstones[at] == number else number
        return None


@dataclasses.dataclass
class Resolved:
    """A group resolved in order: per write its outcome, the documents to store, the doc numbers to tombstone."""

    outcomes: list[tuple[list[str], list[str], list[str]] | Exception]
    keep: list[tuple[int, int]]  # (write, document) of the documents stored, in order
    tombstones: np.ndarray


def resolve_writes(state: IndexState, requests: Sequence[WriteRequest], limits: WriteLimits) -> Resolved:
    """Apply the writes in order, as if one after the other: each sees the ones before it.
    A write that deletes an id that is not there, or gives a metadata field a type the index
    holds another type for, fails alone; a document upserted twice in the group is stored once."""
    pending: dict[str, tuple[str, int] | None] = {}  # id -> ("old", doc number) | ("new", slot) | None
    slots: list[tuple[int, int]] = []
    alive: set[int] = set()
    dead: list[int] = []
    schema = dict(state.schema)
    outcomes: list[tuple[list[str], list[str], list[str]] | Exception] = []

    def where(doc_id: str) -> tuple[str, int] | None:
        if doc_id in pending:
            return pending[doc_id]
        number = state.live_number(doc_id)
        return None if number is None else ("old", number)

    def drop(location: tuple[str, int] | None) -> None:
        if location is None:
            return
        kind, value = location
        if kind == "old":
            dead.append(value)
        else:
            alive.discard(value)

    for r, request in enumerate(requests):
        missing = [doc_id for doc_id in request.deletes if where(doc_id) is None]
        if missing:
            outcomes.append(DocumentNotFoundError(f"no document with id {missing[0]!r}"))
            continue
        try:
            merged = dict(schema)
            for name, kind in request.fields.items():
                try:
                    merged[name] = merge_types(merged.get(name), kind) or kind
                except ValueError as exc:  # the index holds this field with another type
                    raise ConflictError(f"metadata field {name!r} {exc}") from None
            check_field_count(merged, limits.metadata)
        except ConflictError as exc:
            outcomes.append(exc)
            continue
        except ValueError as exc:
            outcomes.append(InvalidParameterError(str(exc)))
            continue
        schema = merged
        created: list[str] = []
        replaced: list[str] = []
        for doc_id in request.deletes:
            drop(where(doc_id))
            pending[doc_id] = None
        for i, doc_id in enumerate(request.upserts):
            location = where(doc_id)
            (replaced if location is not None else created).append(doc_id)
            drop(location)
            alive.add(len(slots))
            pending[doc_id] = ("new", len(slots))
            slots.append((r, i))
        outcomes.append((created, replaced, list(request.deletes)))
    keep = [slots[s] for s in sorted(alive)]
    return Resolved(outcomes, keep, np.unique(np.asarray(dead, dtype=np.int64)))


def gather_kept(encoded: Sequence[EncodedDocuments | None], keep: Sequence[tuple[int, int]]) -> EncodedDocuments:
    """The kept (write, document) pairs of a group, in order, as one EncodedDocuments."""
    parts = []
    for r in sorted({r for r, _ in keep}):
        part = encoded[r]
        assert part is not None, "a write with upserts was encoded"
        parts.append(part.take([i for w, i in keep if w == r]))
    return parts[0] if len(parts) == 1 else EncodedDocuments.concat(parts)


