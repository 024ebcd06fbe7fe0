"""What a reshard moves, as bundles on the store: documents read back from an index's stored
records (no encoder: the vectors are the ones the index scores), their passage and metadata
lines, and ids to delete.

A bundle is `moves/<move>/bundle-NNNNNN.npz` beside the shard map, with a sidecar
`bundle-NNNNNN.json` that gives its size and sha256 (written second: a bundle is complete once
its sidecar is there). The npz holds plain arrays only (read with allow_pickle=False):

    ids        [n] bytes   the documents' ids            lines      uint8, offsets [n + 1] int64
    cls        [n, d_cls] float16                         bow        [sum(counts), d_bow] float16
    counts     [n] int32   stored vectors per document    deletes    [m] bytes ids to delete
    replace    [] bool     the first bundle of a whole copy of the slots: the target first drops
                           what it holds of them (a resharder that went on after a stop)

The target's writer applies bundles in order (espn.live.replication.slots), each as one
generation: the documents are appended through its own record writer (its storage type and
codec; stored vectors are not pooled again), assigned to its IVF lists by its quantizer, and
their passages go to its full-text index. Pooling groups are not carried: explaining a moved
document of a pooled index re-encodes its passage, as for an index built before groups were kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from espn.errors import IndexCorruptError, InvalidParameterError
from espn.generation.segments import LiveView
from espn.ids import MAX_ID_BYTES, decode_doc_id
from espn.partitioning import slots_of
from espn.store import open_reader
from espn.store.format import StoreLayout
from espn.untrusted import load_json

from ..encoding import EncodedDocuments
from ..segment_files import projection_sha

__all__ = ["BUNDLE_DOCUMENTS", "MAX_BUNDLE_BYTES", "Bundle", "moving_documents", "read_stored", "bundle_bytes",
           "parse_bundle", "sidecar", "check_sidecar"]

#: Documents per bundle: bounds what the target holds in memory while it applies one.
BUNDLE_DOCUMENTS = 20_000
#: The most bytes of a bundle a writer fetches (a bundle of BUNDLE_DOCUMENTS long passages is ~200 MB).
MAX_BUNDLE_BYTES = 1 << 30
_READ_BLOCK = 4096
_MAX_SIDECAR_BYTES = 4096
_MAX_LINE_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class Bundle:
    """A bundle as the target applies it: documents to upsert (stored vectors), ids to delete,
    and whether it starts a whole copy of the slots (`replace`)."""

    documents: EncodedDocuments | None
    deletes: list[str]
    replace: bool = False


def moving_documents(view: LiveView, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The live documents of `view` whose id's slot is in `slots` ([SLOT_COUNT] bool): (their
    doc numbers [n] int64, ascending; their ids [n] bytes). One pass over each segment's ids."""
    numbers, ids = [], []
    for first, id_map in zip(view.ids.firsts, view.ids.maps):
        part = np.asarray(id_map.ids)
        if not len(part):
            continue
        hit = slots[slots_of(part)] & (np.char.str_len(part) > 0)  # a merged segment's holes have no id
        local = np.flatnonzero(hit)
        if view.live is not None:
            local = local[view.live[int(first) + local]]
        numbers.append(int(first) + local)
        ids.append(part[local])
    if not numbers:
        return np.zeros(0, np.int64), np.zeros(0, dtype="S1")
    width = max(max((a.dtype.itemsize for a in ids), default=1), 1)
    return np.concatenate(numbers), np.concatenate([a.astype(f"S{width}") for a in ids])


def read_stored(view: LiveView, numbers: np.ndarray) -> EncodedDocuments:
    """The documents `numbers` of `view` as their records store them (CLS, the stored BOW vectors
    with their count) and their docs.jsonl lines; no encoder runs."""
    layout = dataclasses.replace(StoreLayout.from_manifest(view.base.manifest["store"], view.base.path), pool_factor=1)
    reader = open_reader("mmap", view.embeddings, view.records, layout)  # type: ignore[arg-type]
    cls_parts, bow_parts, count_parts = [], [], []
    try:
        for at in range(0, len(numbers), _READ_BLOCK):
            data = reader.read(numbers[at: at + _READ_BLOCK])
            cls_parts.append(data.cls.numpy().astype(np.float16))
            bow_parts.append(data.vectors.numpy().astype(np.float16))
            count_parts.append(np.diff(data.offsets).astype(np.int32))
    finally:
        reader.close()
    d_cls, d_bow = layout.d_cls, layout.d_bow
    return EncodedDocuments(view.ids.external(numbers), _lines(view, numbers),
                            np.concatenate(cls_parts) if cls_parts else np.zeros((0, d_cls), np.float16),
                            np.concatenate(bow_parts) if bow_parts else np.zeros((0, d_bow), np.float16),
                            np.concatenate(count_parts) if count_parts else np.zeros(0, np.int32), stored=True,
                            projection=projection_sha(view.base))


def _lines(view: LiveView, numbers: np.ndarray) -> list[bytes]:
    """The docs.jsonl line of each doc number, read segment by segment from one mapping each."""
    firsts = np.asarray(view.ids.firsts, dtype=np.int64)
    seg = np.searchsorted(firsts, numbers, side="right") - 1
    out: list[bytes] = [b""] * len(numbers)
    for s in np.unique(seg):
        store = view.docs.stores[int(s)]
        where = np.flatnonzero(seg == s)
        local = numbers[where] - firsts[s]
        blob = np.memmap(store.path, dtype=np.uint8, mode="r")
        starts, ends = store.offsets[local], store.offsets[local + 1]
        for i, start, end in zip(where.tolist(), starts.tolist(), ends.tolist()):
            out[i] = blob[start:end].tobytes()
        del blob
    return out


def bundle_bytes(documents: EncodedDocuments | None, deletes: Sequence[str], replace: bool = False) -> bytes:
    """A bundle's npz bytes."""
    if documents is not None and documents.images is not None:
        raise InvalidParameterError("a reshard moves text indexes; an index of page images cannot be resharded yet")
    n = len(documents) if documents is not None else 0
    lines = documents.lines if documents is not None else []
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(line) for line in lines], out=offsets[1:])
    arrays: dict[str, Any] = {"ids": np.array([i.encode() for i in documents.ids] if documents else [], dtype=bytes),
              "lines": np.frombuffer(b"".join(lines), dtype=np.uint8), "line_offsets": offsets,
              "cls": documents.cls if documents else np.zeros((0, 1), np.float16),
              "bow": documents.bow if documents else np.zeros((0, 1), np.float16),
              "counts": documents.counts.astype(np.int32) if documents else np.zeros(0, np.int32),
              "deletes": np.array([d.encode() for d in deletes], dtype=bytes), "replace": np.array(replace),
              # the projection the stored vectors went through (espn.store.projection; b"": none)
              "projection": np.array((documents.projection if documents and documents.projection else "").encode())}
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def sidecar(data: bytes, documents: int, deletes: int, source_generation: int) -> bytes:
    return json.dumps({"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "documents": documents,
                       "deletes": deletes, "source_generation": source_generation}).encode()


def check_sidecar(body: bytes, what: str) -> dict[str, Any]:
    """The sidecar's fields, checked (bytes within MAX_BUNDLE_BYTES, a sha256)."""
    obj = load_json(body, what, max_bytes=_MAX_SIDECAR_BYTES, error=IndexCorruptError, finite=True)
    try:
        size, digest = int(obj["bytes"]), str(obj["sha256"])
    except (KeyError, TypeError, ValueError) as exc:
        raise IndexCorruptError(f"{what}: not a bundle sidecar ({type(exc).__name__}: {exc})") from None
    if not 0 < size <= MAX_BUNDLE_BYTES or len(digest) != 64:
        raise IndexCorruptError(f"{what}: a bundle of {size} bytes (at most {MAX_BUNDLE_BYTES}) and sha256 "
                                f"{digest[:70]!r}: refused")
    return dict(obj)


def parse_bundle(data: bytes, what: str, layout: StoreLayout) -> Bundle:
    """A bundle's arrays checked against the target's layout (dims) and one another: IndexCorruptError otherwise."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in ("ids", "lines", "line_offsets", "cls", "bow", "counts", "deletes",
                                                   "replace")}
            projection = npz["projection"] if "projection" in npz.files else np.array(b"")
    except (OSError, ValueError, KeyError, EOFError) as exc:
        raise IndexCorruptError(f"{what}: not a bundle ({type(exc).__name__}: {exc})") from None
    ids, offsets, counts = arrays["ids"], arrays["line_offsets"], arrays["counts"]
    n = len(ids)
    problems = [
        ids.dtype.kind != "S" or ids.dtype.itemsize > MAX_ID_BYTES or arrays["deletes"].dtype.kind not in "S",
        offsets.dtype != np.int64 or offsets.shape != (n + 1,) or (n and (offsets[0] != 0 or np.any(np.diff(offsets) < 0)
                                                                         or offsets[-1] != len(arrays["lines"]))),
        counts.dtype != np.int32 or counts.shape != (n,) or (n and counts.min() < 0),
        n and (arrays["cls"].dtype != np.float16 or arrays["cls"].shape != (n, layout.d_cls)),
        n and (arrays["bow"].dtype != np.float16 or arrays["bow"].shape != (int(counts.sum()), layout.d_bow)),
        arrays["replace"].dtype != np.bool_ or arrays["replace"].shape != (),
        projection.dtype.kind != "S" or projection.shape != () or projection.dtype.itemsize > 64,
    ]
    if any(bool(p) for p in problems):
        raise IndexCorruptError(f"{what}: its arrays do not fit together or the index's {layout.d_cls}/{layout.d_bow} "
                                "dimensions; nothing of it was applied")
    blob = arrays["lines"].tobytes()
    lines = [blob[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    for line in lines:  # each a passage line as docs.jsonl holds it: a JSON object, depth and size bounded
        if not isinstance(load_json(line, what, max_bytes=_MAX_LINE_BYTES, error=IndexCorruptError), dict):
            raise IndexCorruptError(f"{what}: a passage line is not a JSON object; nothing of it was applied")
    documents = None
    if n:
        documents = EncodedDocuments(_ids(ids, what), lines, arrays["cls"], arrays["bow"], counts, stored=True,
                                     projection=projection.item().decode("ascii", "replace") or None)
    return Bundle(documents, _ids(arrays["deletes"], what), bool(arrays["replace"]))


def _ids(raw: np.ndarray, what: str) -> list[str]:
    try:
        return [decode_doc_id(value, f"{what}: an id") for value in raw.tolist()]
    except InvalidParameterError as exc:
        raise IndexCorruptError(str(exc)) from None
