"""A cheap first pass over the corpus: every line parsed, ids checked unique, empty texts counted.

It runs before the encoder is fitted, so a malformed line or a repeated id is one
error line within seconds instead of a failure after the whole encode (or inside the
tokenising worker). Ids are kept as 8-byte hashes in a numpy array, not as Python
strings: memory stays 8 bytes a document, and only a hash collision costs a second pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from array import array
from pathlib import Path

import numpy as np

from espn.corpus import iter_corpus
from espn.errors import CorpusError
from espn.metadata import check_field_count, merge_types, value_type

__all__ = ["CorpusScan", "scan_corpus"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CorpusScan:
    documents: int  # documents the build will index (bad lines skipped with skip_bad)
    empty: int  # documents without title or text: indexed with no BOW vectors
    metadata_fields: dict[str, str] = dataclasses.field(default_factory=dict)  # field -> type


def _hash(doc_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest(), "little")


def scan_corpus(corpus: Path, skip_bad: bool = False) -> CorpusScan:
    """Parse every line; raise CorpusError naming the lines of the first repeated id."""
    hashes = array("Q")
    empty = 0
    fields: dict[str, str] = {}  # one entry per metadata field, not per document
    for doc in iter_corpus(corpus, skip_bad=skip_bad):
        hashes.append(_hash(doc.doc_id))
        if doc.metadata:
            for name, value in doc.metadata.items():
                try:
                    kind = merge_types(fields.get(name), value_type(value))
                except ValueError as exc:
                    raise CorpusError(f"{corpus}:{doc.line}: metadata field {name!r} {exc}") from None
                if kind is not None and name not in fields:
                    fields[name] = kind
                    try:
                        check_field_count(fields)
                    except ValueError as exc:
                        raise CorpusError(f"{corpus}:{doc.line}: {exc}") from None
                elif kind is not None:
                    fields[name] = kind
        if not (doc.title.strip() or doc.text.strip()):
            empty += 1
    values = np.frombuffer(hashes, dtype=np.uint64) if len(hashes) else np.zeros(0, np.uint64)
    ordered = np.sort(values)
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(repeated):
        _raise_duplicate(corpus, skip_bad, set(int(h) for h in np.unique(repeated)))
    if empty:
        log.warning("%s: %d document(s) have no text; they are indexed with no BOW vectors "
                    "(fetchable by id, found only by their CLS vector)", corpus, empty)
    return CorpusScan(documents=len(values), empty=empty, metadata_fields=fields)


def _raise_duplicate(corpus: Path, skip_bad: bool, suspects: set[int]) -> None:
    """Second pass over the few ids whose hashes collide: a real repeat, or a hash collision."""
    seen: dict[str, int] = {}
    for doc in iter_corpus(corpus, skip_bad=skip_bad):
        if _hash(doc.doc_id) in suspects:
            if doc.doc_id in seen:
                raise CorpusError(f"{corpus}:{doc.line}: duplicate document id {doc.doc_id!r} "
                                  f"(first on line {seen[doc.doc_id]}); ids must be unique")
            seen[doc.doc_id] = doc.line
