"""What the full-text engine (Tantivy) stores and which files make one generation: the
schema, a passage as an engine document, opening a directory, listing and checking its files.
The reader side is `espn.text.engine`, the writer `espn.text.writer`."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import tantivy

from ..corpus import passage_text
from ..errors import IndexCorruptError, InvalidParameterError
from ..files.checksums import sha256_file
from .config import TOKENIZER_NAME, TextConfig

__all__ = ["TextDocument", "ENGINE", "FIELD_DOC", "FIELD_BODY", "TERM_SET_MAX", "SEGMENT_FILE", "schema", "open_index",
           "to_document", "engine_files", "check_files"]

ENGINE = "tantivy"
FIELD_DOC = "doc_number"
FIELD_BODY = "body"
#: Below this many allowed documents a restricted search asks the engine for exactly those
#: (a term set on the doc-number field); above it, it reads deeper into the ranking instead.
TERM_SET_MAX = 20_000
SEGMENT_FILE = re.compile(r"^([0-9a-f]{32})\.")



@dataclasses.dataclass(frozen=True)
class TextDocument:
    doc_number: int
    title: str
    text: str


def schema() -> Any:
    builder = tantivy.SchemaBuilder()
    builder.add_unsigned_field(FIELD_DOC, stored=False, indexed=True, fast=True)
    builder.add_text_field(FIELD_BODY, stored=False, tokenizer_name=TOKENIZER_NAME, index_option="position")
    return builder.build()


def open_index(directory: Path, config: TextConfig) -> Any:
    try:
        index = tantivy.Index.open(str(directory))
    except (ValueError, OSError) as exc:
        raise IndexCorruptError(f"{directory}: unreadable full-text index ({exc})") from None
    index.register_tokenizer(TOKENIZER_NAME, config.analyzer())
    return index


def to_document(doc: TextDocument) -> Any:
    if isinstance(doc.doc_number, bool) or not isinstance(doc.doc_number, (int, np.integer)) or doc.doc_number < 0:
        raise InvalidParameterError(f"doc_number must be an integer >= 0, got {doc.doc_number!r}")
    out = tantivy.Document()
    out.add_unsigned(FIELD_DOC, int(doc.doc_number))
    out.add_text(FIELD_BODY, passage_text(doc.title, doc.text))
    return out


def engine_files(directory: Path, meta: Mapping[str, Any] | None = None) -> list[str]:
    """The files a committed state needs: meta.json and every file of the segments it names
    (the engine's lock and bookkeeping files are not part of the index). meta: the parsed
    meta.json to list the files of (default: the directory's)."""
    if meta is None:
        meta = json.loads((Path(directory) / "meta.json").read_text(encoding="utf-8"))
    segments = {s["segment_id"].replace("-", ""): s for s in meta["segments"]}
    names = ["meta.json"]
    for name in sorted(os.listdir(directory)):
        match = SEGMENT_FILE.match(name)
        if match is None or match.group(1) not in segments:
            continue
        deletes = segments[match.group(1)].get("deletes")
        if name.endswith(".del") and (deletes is None or name != f"{match.group(1)}.{deletes['opstamp']}.del"):
            continue  # an older deletion file of the segment
        names.append(name)
    missing = [s for s in segments if not any(n.startswith(s) for n in names)]
    if missing:
        raise FileNotFoundError(f"{directory}: no files for segment(s) {', '.join(missing)}")
    return names


def check_files(directory: Path, files: Mapping[str, Mapping[str, Any]], full: bool) -> None:
    """Sizes (and with `full` sha256) of a text directory against its recorded entries."""
    for name, expected in files.items():
        path = Path(directory) / name
        if not path.is_file():
            raise IndexCorruptError(f"{path}: missing")
        if path.stat().st_size != expected["bytes"]:
            raise IndexCorruptError(f"{path}: {path.stat().st_size} bytes, expected {expected['bytes']}")
        if full and expected.get("sha256") and sha256_file(path) != expected["sha256"]:
            raise IndexCorruptError(f"{path}: checksum mismatch (corrupted)")
