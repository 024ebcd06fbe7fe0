"""Per-document metadata as columnar numpy arrays: written at build time, memory-mapped at search time.

A corpus line may carry `"metadata": {"field": value, ...}`. Each field becomes one column
indexed by internal doc number (no Python object per document), stored under
`INDEX/metadata/` and described in the manifest's `metadata` section:

| type       | JSON values       | files (`f{i}.*.npy`)                                           |
|------------|-------------------|----------------------------------------------------------------|
| `keyword`  | string            | `codes` [N] int32 (-1 = missing), `dict` [D] utf-8 bytes        |
| `keywords` | list of strings   | `offsets` [N+1] int64, `codes` [total] int32, `dict` [D] bytes  |
| `integer`  | int               | `values` [N] int64, `present` [N] bool                          |
| `float`    | number            | `values` [N] float64, `present` [N] bool                        |
| `boolean`  | true / false      | `values` [N] int8 (-1 = missing, 0, 1)                          |

A keyword's code is its position in the field's dictionary, in order of first
appearance. The dictionary is only ever appended to, so an appender (a delta segment, a
live `add`) keeps every existing code valid: it appends new values to `dict` and new rows
to the per-document arrays, and columns of several segments concatenate along the doc
axis. A missing value and JSON `null` are the same thing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from array import array
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .errors import CorpusError, IndexCorruptError
from .mapped import map_npy

__all__ = [
    "MetadataLimits",
    "DEFAULT_LIMITS",
    "check_field_count",
    "FIELD_TYPES",
    "value_type",
    "check_metadata",
    "merge_types",
    "MetadataWriter",
    "write_columns",
    "MetadataColumns",
    "SegmentedColumns",
    "add_from_passages",
    "schema_of",
    "KeywordColumn",
    "KeywordsColumn",
    "NumberColumn",
    "BooleanColumn",
]

FIELD_TYPES = ("keyword", "keywords", "integer", "float", "boolean")
FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")  # fullmatch: "$" would admit a trailing newline
#: Filter operators: a field of this name could not be told apart from them.
RESERVED_NAMES = frozenset({"and", "or", "not"})
DIRECTORY = "metadata"


@dataclasses.dataclass(frozen=True)
class MetadataLimits:
    """Bounds on metadata: every field is a column (a file per part, a filter's unit of work),
    so their number per document and per index is bounded, as is a document's JSON size."""

    fields_per_document: int = 64
    bytes_per_document: int = 16 << 10  # the metadata object as compact JSON, UTF-8
    fields_per_index: int = 256


DEFAULT_LIMITS = MetadataLimits()


def value_type(value: Any) -> str | None:
    """The field type a JSON value implies (None for null); ValueError for anything unsupported."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 63):
            raise ValueError("integer outside the 64-bit range")
        return "integer"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("number is not finite")
        return "float"
    if isinstance(value, str):
        return "keyword"
    if isinstance(value, list):
        if all(isinstance(item, str) for item in value):
            return "keywords"
        raise ValueError("a list must hold strings only (a list of keywords; nested lists and objects are not "
                         "allowed)")
    if isinstance(value, dict):
        raise ValueError("nested objects are not allowed (a value is a keyword, a list of keywords, an integer, "
                         "a float, a boolean or null)")
    raise ValueError(f"unsupported value type {type(value).__name__} (keyword, list of keywords, integer, "
                     f"float, boolean or null)")


def check_metadata(metadata: Any, limits: MetadataLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Validate one document's `metadata` object; ValueError naming the field or the limit."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise ValueError(f"'metadata' must be a JSON object, got {type(metadata).__name__}")
    if len(metadata) > limits.fields_per_document:
        raise ValueError(f"'metadata' has {len(metadata)} fields; at most {limits.fields_per_document} per document")
    for name, value in metadata.items():
        if not isinstance(name, str) or not FIELD_NAME.fullmatch(name) or name in RESERVED_NAMES:
            raise ValueError(f"metadata field name {name!r} is not allowed (letters, digits, _ . -; at most 64; "
                             f"not and/or/not)")
        try:
            value_type(value)
        except ValueError as exc:
            raise ValueError(f"metadata field {name!r}: {exc}") from None
    size = len(json.dumps(metadata, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    if size > limits.bytes_per_document:
        raise ValueError(f"'metadata' is {size} bytes as JSON; at most {limits.bytes_per_document} per document")
    return metadata


def check_field_count(schema: Mapping[str, str], limits: MetadataLimits = DEFAULT_LIMITS) -> None:
    """ValueError when an index would hold more metadata fields than `limits` allow."""
    if len(schema) > limits.fields_per_index:
        raise ValueError(f"the index would hold {len(schema)} metadata fields; at most {limits.fields_per_index} "
                         f"per index")


def merge_types(old: str | None, new: str | None) -> str | None:
    """The type of a field seen as `old` so far and `new` now; ValueError when they conflict.

    Integers and floats mix into float; a keyword and a list of keywords into keywords.
    """
    if old is None or new is None or old == new:
        return old or new
    pair = {old, new}
    if pair == {"integer", "float"}:
        return "float"
    if pair == {"keyword", "keywords"}:
        return "keywords"
    raise ValueError(f"holds {new} here but {old} in earlier documents")


class _Dictionary:
    """Keyword -> code in order of first appearance (one entry per distinct value, not per document)."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {}

    def code(self, value: str) -> int:
        code = self.codes.get(value)
        if code is None:
            code = self.codes[value] = len(self.codes)
        return code

    def save(self, path: Path) -> None:
        encoded = [value.encode("utf-8") for value in self.codes]
        width = max([1] + [len(e) for e in encoded])
        np.save(path, np.array(encoded, dtype=f"S{width}") if encoded else np.zeros(0, dtype="S1"))


class _FieldWriter:
    """One column being filled, document by document, into preallocated memmaps."""

    def __init__(self, folder: Path, prefix: str, kind: str, n_docs: int) -> None:
        self.folder, self.prefix, self.kind, self.n_docs = folder, prefix, kind, n_docs
        self.arrays: dict[str, np.ndarray] = {}  # np.memmap each
        self.dictionary = _Dictionary()
        self.list_codes = array("i")
        if kind == "keyword":
            self._alloc("codes", np.int32, -1)
        elif kind == "keywords":
            self._alloc("lengths", np.int32, 0)
        elif kind in ("integer", "float"):
            self._alloc("values", np.int64 if kind == "integer" else np.float64, 0)
            self._alloc("present", np.bool_, False)
        else:
            self._alloc("values", np.int8, -1)

    def _alloc(self, part: str, dtype: Any, fill: Any) -> None:
        array_ = np.lib.format.open_memmap(self.folder / f"{self.prefix}.{part}.npy", mode="w+", dtype=dtype,
                                           shape=(self.n_docs,))
        array_[:] = fill
        self.arrays[part] = array_

    def promote(self, kind: str) -> None:
        """integer -> float, keyword -> keywords, keeping what was written."""
        if kind == self.kind:
            return
        if self.kind == "integer" and kind == "float":
            old = np.array(self.arrays["values"])
            self._alloc("values", np.float64, 0)
            self.arrays["values"][:] = old
        elif self.kind == "keyword" and kind == "keywords":
            old_codes = np.array(self.arrays.pop("codes"))
            (self.folder / f"{self.prefix}.codes.npy").unlink()
            self._alloc("lengths", np.int32, 0)
            present = old_codes >= 0
            self.arrays["lengths"][present] = 1
            self.list_codes = array("i", old_codes[present].tolist())  # once per promotion, at build time
        self.kind = kind

    def set(self, doc: int, value: Any) -> None:
        kind = self.kind
        if kind == "keyword":
            self.arrays["codes"][doc] = self.dictionary.code(value)
        elif kind == "keywords":
            values = [value] if isinstance(value, str) else value
            self.arrays["lengths"][doc] = len(values)
            self.list_codes.extend(self.dictionary.code(v) for v in values)
        elif kind == "boolean":
            self.arrays["values"][doc] = 1 if value else 0
        else:
            self.arrays["values"][doc] = value
            self.arrays["present"][doc] = True

    def finish(self) -> None:
        if self.kind in ("keyword", "keywords"):
            self.dictionary.save(self.folder / f"{self.prefix}.dict.npy")
        if self.kind == "keywords":
            lengths = self.arrays.pop("lengths")
            offsets = np.zeros(self.n_docs + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            del lengths
            (self.folder / f"{self.prefix}.lengths.npy").unlink()
            np.save(self.folder / f"{self.prefix}.offsets.npy", offsets)
            codes = np.frombuffer(self.list_codes, dtype=np.int32) if len(self.list_codes) else np.zeros(0, np.int32)
            np.save(self.folder / f"{self.prefix}.codes.npy", codes)
        for array_ in self.arrays.values():
            array_.flush()  # type: ignore[attr-defined]  # np.memmap
        self.arrays.clear()


class MetadataWriter:
    """Writes the columns of `n_docs` documents into `directory/metadata/`, fields as they appear.

    Memory: the per-document arrays are memmaps; only keyword dictionaries (distinct
    values) and the codes of list fields are held in the process, as compact arrays.
    """

    def __init__(self, directory: Path, n_docs: int) -> None:
        self.folder = Path(directory) / DIRECTORY
        self.n_docs = n_docs
        self.fields: dict[str, _FieldWriter] = {}

    def add(self, doc: int, metadata: Mapping[str, Any], where: str = "") -> None:
        """Record document `doc`'s metadata (already checked with `check_metadata`)."""
        for name, value in metadata.items():
            kind = value_type(value)
            if kind is None:
                continue
            field = self.fields.get(name)
            if field is None:
                self.folder.mkdir(parents=True, exist_ok=True)
                field = self.fields[name] = _FieldWriter(self.folder, f"f{len(self.fields)}", kind, self.n_docs)
            try:
                field.promote(merge_types(field.kind, kind) or kind)
            except ValueError as exc:
                raise CorpusError(f"{where or f'document #{doc + 1}'}: metadata field {name!r} {exc}") from None
            field.set(doc, value)

    def finish(self) -> dict[str, Any] | None:
        """Flush every column; the manifest's `metadata` section (None: no document had any)."""
        if not self.fields:
            return None
        for field in self.fields.values():
            field.finish()
        return {"fields": [{"name": name, "type": f.kind, "file": f"{DIRECTORY}/{f.prefix}"}
                           for name, f in self.fields.items()]}


def add_from_passages(writer: MetadataWriter, lines: Iterable[bytes], first: int = 0) -> None:
    """Columns from passage JSON lines (docs.jsonl), which carry each document's metadata:
    what the build, a live `add` and compaction all store, so all three agree."""
    for i, line in enumerate(lines):
        if b'"metadata"' in line:
            meta = json.loads(line).get("metadata")
            if meta:
                writer.add(first + i, meta)


def schema_of(sections: Sequence[Mapping[str, Any] | None]) -> dict[str, str]:
    """Field name -> type over several segments' `metadata` sections; ValueError on a conflict."""
    schema: dict[str, str] = {}
    for section in sections:
        for spec in (section or {}).get("fields", []):
            try:
                merged = merge_types(schema.get(spec["name"]), spec["type"])
            except ValueError as exc:
                raise ValueError(f"metadata field {spec['name']!r} {exc}") from None
            assert merged is not None
            schema[spec["name"]] = merged
    return schema


def write_columns(directory: Path, fields: list[tuple[str, str, dict[str, np.ndarray]]]) -> dict[str, Any]:
    """Save whole columns made elsewhere (e.g. synthetic ones): (name, type, {part: array}) each,
    with the parts of the table above. Returns the manifest's `metadata` section."""
    folder = Path(directory) / DIRECTORY
    folder.mkdir(parents=True, exist_ok=True)
    section = []
    for i, (name, kind, parts) in enumerate(fields):
        if kind not in FIELD_TYPES or not FIELD_NAME.fullmatch(name) or name in RESERVED_NAMES:
            raise ValueError(f"metadata field {name!r} of type {kind!r} is not allowed")
        for part, values in parts.items():
            np.save(folder / f"f{i}.{part}.npy", values)
        section.append({"name": name, "type": kind, "file": f"{DIRECTORY}/f{i}"})
    return {"fields": section}


# -- reading ------------------------------------------------------------------------------

class KeywordColumn:
    """codes [N] int32 (-1 = missing) into `dictionary` [D] utf-8 bytes."""

    type = "keyword"

    def __init__(self, codes: np.ndarray, dictionary: np.ndarray) -> None:
        self.codes, self.dictionary = codes, dictionary
        self._order = np.argsort(dictionary, kind="stable")  # [D]: per distinct value, not per document

    def lookup(self, values: list[str]) -> np.ndarray:
        """Codes of `values` [n] int64; values not in the dictionary are left out (they match nothing)."""
        if len(self.dictionary) == 0 or not values:
            return np.zeros(0, dtype=np.int64)
        keys = np.array([v.encode("utf-8") for v in values], dtype=bytes)
        sorted_dict = self.dictionary[self._order]
        where = np.clip(np.searchsorted(sorted_dict, keys), 0, len(sorted_dict) - 1)
        found = sorted_dict[where] == keys
        return np.asarray(self._order[where[found]], dtype=np.int64)

    def _table(self, codes: np.ndarray) -> np.ndarray:
        table = np.zeros(len(self.dictionary) + 1, dtype=bool)  # slot 0: missing (code -1)
        table[codes + 1] = True
        return table

    def any_of(self, values: list[str]) -> np.ndarray:
        """[N] bool: the document's value is one of `values`."""
        return self._table(self.lookup(values))[np.asarray(self.codes, dtype=np.int64) + 1]

    def present(self) -> np.ndarray:
        return np.asarray(self.codes) >= 0


class KeywordsColumn(KeywordColumn):
    """A list of keywords per document: offsets [N+1] int64 into codes [total] int32."""

    type = "keywords"

    def __init__(self, offsets: np.ndarray, codes: np.ndarray, dictionary: np.ndarray) -> None:
        super().__init__(codes, dictionary)
        self.offsets = offsets

    def any_of(self, values: list[str]) -> np.ndarray:
        """[N] bool: at least one of the document's values is in `values`."""
        hit = self._table(self.lookup(values))[np.asarray(self.codes, dtype=np.int64) + 1]
        counts = np.concatenate([[0], np.cumsum(hit, dtype=np.int64)])
        offsets = np.asarray(self.offsets)
        return counts[offsets[1:]] > counts[offsets[:-1]]

    def present(self) -> np.ndarray:
        offsets = np.asarray(self.offsets)
        return offsets[1:] > offsets[:-1]


class NumberColumn:
    """values [N] int64 or float64, present [N] bool."""

    def __init__(self, kind: str, values: np.ndarray, present: np.ndarray) -> None:
        self.type, self.values, self._present = kind, values, present

    def present(self) -> np.ndarray:
        return np.asarray(self._present)


class BooleanColumn:
    """values [N] int8: -1 missing, 0 false, 1 true."""

    type = "boolean"

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def present(self) -> np.ndarray:
        return np.asarray(self.values) >= 0


Column = KeywordColumn | NumberColumn | BooleanColumn


class MetadataColumns:
    """The memory-mapped columns of an index, by field name (empty when it has no metadata)."""

    def __init__(self, fields: dict[str, Column], num_documents: int) -> None:
        self.fields, self.num_documents = fields, num_documents

    @property
    def schema(self) -> dict[str, str]:
        """Field name -> type."""
        return {name: column.type for name, column in self.fields.items()}

    @classmethod
    def open(cls, path: Path, manifest: Mapping[str, Any]) -> "MetadataColumns":
        n_docs = int(manifest["counts"]["documents"])
        section = manifest.get("metadata") or {"fields": []}
        fields: dict[str, Column] = {}
        for spec in section["fields"]:
            def load(part: str) -> np.ndarray:
                file = Path(path) / f"{spec['file']}.{part}.npy"
                try:
                    return map_npy(file)
                except (ValueError, OSError) as exc:
                    raise IndexCorruptError(f"{file}: unreadable ({exc})") from None

            kind = spec["type"]
            column: Column
            if kind == "keyword":
                column = KeywordColumn(load("codes"), load("dict"))
            elif kind == "keywords":
                column = KeywordsColumn(load("offsets"), load("codes"), load("dict"))
            elif kind in ("integer", "float"):
                column = NumberColumn(kind, load("values"), load("present"))
            elif kind == "boolean":
                column = BooleanColumn(load("values"))
            else:
                raise IndexCorruptError(f"{path}: metadata field {spec['name']!r} has unknown type {kind!r}")
            rows = len(column.offsets) - 1 if isinstance(column, KeywordsColumn) else len(
                column.codes if isinstance(column, KeywordColumn) else column.values)
            if rows != n_docs:
                raise IndexCorruptError(f"{path}: metadata field {spec['name']!r} has {rows} rows, "
                                        f"the index {n_docs} documents")
            fields[spec["name"]] = column
        return cls(fields, n_docs)

    def with_fields(self, schema: Mapping[str, str]) -> "MetadataColumns":
        """These columns plus an all-missing one for each field of `schema` they lack (a field
        that only another segment's documents carry)."""
        missing = {name: kind for name, kind in schema.items() if name not in self.fields}
        if not missing:
            return self
        n = self.num_documents
        fields = dict(self.fields)
        for name, kind in missing.items():
            empty = np.zeros(0, dtype="S1")
            if kind == "keyword":
                fields[name] = KeywordColumn(np.full(n, -1, dtype=np.int32), empty)
            elif kind == "keywords":
                fields[name] = KeywordsColumn(np.zeros(n + 1, dtype=np.int64), np.zeros(0, np.int32), empty)
            elif kind in ("integer", "float"):
                fields[name] = NumberColumn(kind, np.zeros(n, np.int64 if kind == "integer" else np.float64),
                                            np.zeros(n, dtype=bool))
            else:
                fields[name] = BooleanColumn(np.full(n, -1, dtype=np.int8))
        return MetadataColumns(fields, n)


class SegmentedColumns:
    """The columns of a live index's segments, one `MetadataColumns` each, in doc-number order.

    A filter compiles per segment (each has its own keyword dictionaries) and the masks
    concatenate: nothing is copied or re-coded when a segment is added.
    """

    def __init__(self, parts: Sequence[MetadataColumns], schema: Mapping[str, str]) -> None:
        self.schema = dict(schema)
        self.parts = [part.with_fields(self.schema) for part in parts]
        self.num_documents = sum(part.num_documents for part in parts)
