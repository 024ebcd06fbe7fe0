"""Import embedding shards made elsewhere into chunk files (`espn index --embeddings DIR`).

Two layouts are read; which one is detected from the directory.

**ESPN tooling** (what the ESPN paper's ColBERTer scripts write)::

    DIR/CLS/N.npy    [docs_N, d_cls]     float16, one CLS vector per document
    DIR/BOW/N.npy    [vectors_N, d_bow]  float16, every document's BOW vectors, flattened
    DIR/BOW/N.json   [docs_N]            JSON array of ints: BOW vectors per document

Shards N = 0, 1, 2, ... in numeric order (10 after 9, not after 1; leading zeros allowed). Documents are
numbered 0..N-1 in shard order; their ids are those numbers as strings unless a
corpus is given. These embeddings are ColBERTer's, so the BOW score is the raw
MaxSim sum (``bow_reduction = "sum"``); the score weight is not stored.

**espn-precomputed** (this project's own, for any multi-vector model)::

    DIR/embeddings.json  {"format": "espn-precomputed", "version": 1, "d_cls": int, "d_bow": int,
                          "bow_reduction": "mean" | "sum"   (optional, default "mean"),
                          "score_weight": float in [0, 1]   (optional: the model's w)}
    DIR/cls/N.npy        [docs_N, d_cls] float16/32
    DIR/bow/N.npy        [sum(counts_N), d_bow] float16/32, flattened in document order
    DIR/counts/N.npy     [docs_N] integer >= 0
    DIR/ids/N.txt        optional: docs_N lines, one external document id per line (utf-8)

``.npy`` files are memory-mapped, so one shard at a time is touched and the process
holds at most one chunk of copies. Every shard's shapes, counts and numbering are
checked before the first chunk is written; values (NaN, infinity, beyond the float16
range) are checked as they are copied. With ``corpus`` (BEIR jsonl or TSV, same
order as the embeddings) the chunks carry its ids, titles and texts, and a length
mismatch, or an id that differs from ``ids/N.txt``, fails naming the document.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from espn.corpus import iter_corpus
from espn.errors import CorpusError, InvalidParameterError
from espn.mapped import map_npy

from .chunks import write_chunk

__all__ = ["import_embeddings", "scan_embeddings", "ShardFiles", "ESPN_LAYOUT", "OWN_LAYOUT", "OWN_FORMAT"]

log = logging.getLogger(__name__)

ESPN_LAYOUT = "espn"
OWN_LAYOUT = "espn-precomputed"
OWN_FORMAT = {"format": "espn-precomputed", "version": 1}
_NUMBER = re.compile(r"^[0-9]+$")


@dataclasses.dataclass(frozen=True)
class ShardFiles:
    """One validated shard: its files and sizes."""

    number: int
    cls: Path
    bow: Path
    counts: Path  # .json (ESPN layout) or .npy
    ids: Path | None
    documents: int
    vectors: int


def _numbered(folder: Path, suffix: str) -> dict[int, Path]:
    """Shard number -> file for every `*suffix` in `folder`; names must be plain non-negative integers."""
    files: dict[int, Path] = {}
    if not folder.is_dir():
        return files
    for path in folder.iterdir():
        if not path.name.endswith(suffix):
            continue
        stem = path.name[: -len(suffix)]
        if not _NUMBER.match(stem):
            raise CorpusError(f"{path}: shard files must be named N{suffix} with N = 0, 1, 2, ...")
        if int(stem) in files:
            raise CorpusError(f"{path} and {files[int(stem)].name}: two files for shard {int(stem)}")
        files[int(stem)] = path
    return files


def _check_numbering(files: dict[int, Path], folder: Path, suffix: str, expected: int | None) -> None:
    """Shards 0..S-1 without gaps; and the same S as the first kind of file, when given."""
    count = len(files) if expected is None else expected
    for number in range(count):
        if number not in files:
            raise CorpusError(f"{folder / f'{number}{suffix}'}: missing (shards must be numbered 0..{count - 1} "
                              "without gaps)")
    extra = sorted(set(files) - set(range(count)))
    if extra:
        raise CorpusError(f"{files[extra[0]]}: unexpected shard {extra[0]} (the other files stop at {count - 1})")


def _open_npy(path: Path) -> np.ndarray:
    """A .npy memory-mapped, holding no descriptor (an empty one comes back in memory)."""
    try:
        return map_npy(path)
    except (OSError, ValueError) as exc:  # map_npy says ValueError for an empty or truncated file too
        raise CorpusError(f"{path}: not a readable .npy array ({exc})") from exc


def _check_vectors(array: np.ndarray, path: Path, what: str) -> int:
    """A 2-D float array ([rows, dim]); returns dim."""
    if array.ndim != 2 or not (np.issubdtype(array.dtype, np.floating) or array.size == 0):
        raise CorpusError(f"{path}: {what} must be a 2-D float array [rows, dim], got {array.dtype} {array.shape}")
    if array.shape[1] < 1:
        raise CorpusError(f"{path}: {what} vectors have 0 dimensions")
    return int(array.shape[1])


def _read_counts(path: Path) -> np.ndarray:
    """Per-document vector counts [docs] int64, from ESPN's JSON array or a .npy."""
    if path.suffix == ".json":
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorpusError(f"{path}: cannot read the counts: {exc}") from exc
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise CorpusError(f"{path}: expected a JSON array of integers (BOW vectors per document)")
        counts = np.asarray(values, dtype=np.int64)
    else:
        array = _open_npy(path)
        if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
            raise CorpusError(f"{path}: counts must be a 1-D integer array, got {array.dtype} {array.shape}")
        counts = np.asarray(array, dtype=np.int64)
    if len(counts) and counts.min() < 0:
        raise CorpusError(f"{path}: negative count at document {int(np.argmax(counts < 0))}")
    return counts


def _read_ids(path: Path) -> list[str]:
    """One id per line; a final newline is optional, blank ids are errors."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CorpusError(f"{path}: cannot read the ids: {exc}") from exc
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    ids = [line.rstrip("\r") for line in lines]
    for number, value in enumerate(ids, start=1):
        if not value.strip():
            raise CorpusError(f"{path}:{number}: empty document id")
    return ids


def _read_own_meta(source: Path) -> dict[str, Any]:
    path = source / "embeddings.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorpusError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != OWN_FORMAT["format"]:
        raise CorpusError(f"{path}: expected \"format\": \"{OWN_FORMAT['format']}\"")
    if meta.get("version") != OWN_FORMAT["version"]:
        raise CorpusError(f"{path}: unsupported version {meta.get('version')!r} (this reader: {OWN_FORMAT['version']})")
    for key in ("d_cls", "d_bow"):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CorpusError(f"{path}: {key} must be a positive integer, got {value!r}")
    if meta.get("bow_reduction", "mean") not in ("mean", "sum"):
        raise CorpusError(f"{path}: bow_reduction must be 'mean' or 'sum', got {meta['bow_reduction']!r}")
    weight = meta.get("score_weight")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 1):
        raise CorpusError(f"{path}: score_weight must be a number in [0, 1] or null, got {weight!r}")
    return meta


def detect_layout(source: Path) -> str:
    """ESPN_LAYOUT or OWN_LAYOUT, or a CorpusError describing both."""
    if (source / "embeddings.json").is_file():
        return OWN_LAYOUT
    if (source / "CLS").is_dir() and (source / "BOW").is_dir():
        return ESPN_LAYOUT
    raise CorpusError(
        f"{source}: no precomputed embeddings found; expected either ESPN's layout (CLS/N.npy, BOW/N.npy, "
        "BOW/N.json) or embeddings.json with cls/N.npy, bow/N.npy, counts/N.npy (see indexing.precomputed)"
    )


def scan_embeddings(source: Path) -> tuple[str, list[ShardFiles], dict[str, Any]]:
    """Detect and validate a source directory without reading its vectors.

    -> (layout, shards in order, {"d_cls", "d_bow", "bow_reduction", "score_weight"}).
    Checks: shard numbering 0..S-1 in every folder, 2-D float arrays, one d_cls and one
    d_bow across shards (and the declared ones), len(counts) == CLS rows, sum(counts) ==
    BOW rows, ids files with one line per document.
    """
    source = Path(source)
    if not source.is_dir():
        raise CorpusError(f"{source}: no such directory")
    layout = detect_layout(source)
    if layout == ESPN_LAYOUT:
        folders = {"cls": (source / "CLS", ".npy"), "bow": (source / "BOW", ".npy"), "counts": (source / "BOW", ".json")}
        meta: dict[str, Any] = {"bow_reduction": "sum", "score_weight": None}
    else:
        folders = {"cls": (source / "cls", ".npy"), "bow": (source / "bow", ".npy"),
                   "counts": (source / "counts", ".npy"), "ids": (source / "ids", ".txt")}
        declared = _read_own_meta(source)
        meta = {"d_cls": declared["d_cls"], "d_bow": declared["d_bow"],
                "bow_reduction": declared.get("bow_reduction", "mean"), "score_weight": declared.get("score_weight")}
    files = {kind: _numbered(folder, suffix) for kind, (folder, suffix) in folders.items()}
    if not files["cls"]:
        raise CorpusError(f"{folders['cls'][0]}: no shards (N.npy)")
    _check_numbering(files["cls"], *folders["cls"], expected=None)
    shard_count = len(files["cls"])
    for kind in ("bow", "counts"):
        _check_numbering(files[kind], *folders[kind], expected=shard_count)
    if files.get("ids"):
        _check_numbering(files["ids"], *folders["ids"], expected=shard_count)

    shards = []
    for number in range(shard_count):
        cls_path, bow_path, counts_path = files["cls"][number], files["bow"][number], files["counts"][number]
        cls, bow = _open_npy(cls_path), _open_npy(bow_path)
        for key, array, path, what in (("d_cls", cls, cls_path, "CLS"), ("d_bow", bow, bow_path, "BOW")):
            dim = _check_vectors(array, path, what)
            if meta.setdefault(key, dim) != dim:
                raise CorpusError(f"{path}: {what} vectors have {dim} dimensions, "
                                  f"{'embeddings.json declares' if layout == OWN_LAYOUT else 'shard 0 has'} {meta[key]}")
        counts = _read_counts(counts_path)
        if len(counts) != len(cls):
            raise CorpusError(f"{counts_path}: {len(counts)} counts but {cls_path.name} has {len(cls)} CLS rows")
        if int(counts.sum()) != len(bow):
            raise CorpusError(f"{counts_path}: counts sum to {int(counts.sum())} but {bow_path} has {len(bow)} rows")
        ids_path = files.get("ids", {}).get(number)
        if ids_path is not None and len(_read_ids(ids_path)) != len(cls):
            raise CorpusError(f"{ids_path}: {len(_read_ids(ids_path))} ids but {cls_path.name} has {len(cls)} CLS rows")
        shards.append(ShardFiles(number, cls_path, bow_path, counts_path, ids_path, len(cls), len(bow)))
        del cls, bow
    if sum(s.documents for s in shards) == 0:
        raise CorpusError(f"{source}: the shards hold no documents")
    return layout, shards, meta


def _as_fp16(array: np.ndarray, path: Path, first_row: int) -> np.ndarray:
    """Copy to float16 (the stored type), refusing values that would not survive."""
    with np.errstate(over="ignore"):  # overflow becomes inf, reported below with the row
        half = np.asarray(array, dtype=np.float16)
    if not np.isfinite(half).all():
        bad = int(np.argmax(~np.isfinite(half).all(axis=1)))
        raise CorpusError(f"{path}: row {first_row + bad} holds NaN, infinity or a value beyond float16 (±65504)")
    return half


def _pieces(shards: list[ShardFiles], chunk_size: int) -> Iterator[list[tuple[np.ndarray, np.ndarray, np.ndarray, list[str] | None]]]:
    """Chunks as lists of per-shard pieces (cls, bow, counts, ids-or-None); one shard mapped at a time."""
    pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, list[str] | None]] = []
    filled = 0
    for shard in shards:
        cls, bow = _open_npy(shard.cls), _open_npy(shard.bow)
        counts = _read_counts(shard.counts)
        ids = _read_ids(shard.ids) if shard.ids is not None else None
        ends = np.cumsum(counts)
        starts = ends - counts
        position = 0
        while position < shard.documents:
            take = min(chunk_size - filled, shard.documents - position)
            stop = position + take
            first_vector, last_vector = int(starts[position]), int(ends[stop - 1])
            pending.append((
                _as_fp16(cls[position:stop], shard.cls, position),
                _as_fp16(bow[first_vector:last_vector], shard.bow, first_vector),
                counts[position:stop],
                ids[position:stop] if ids is not None else None,
            ))
            filled += take
            position = stop
            if filled == chunk_size:
                yield pending
                pending, filled = [], 0
        log.info("shard %d: %d documents, %d BOW vectors", shard.number, shard.documents, shard.vectors)
        del cls, bow
    if filled:
        yield pending


def import_embeddings(source_dir: Path, work_dir: Path, chunk_size: int, corpus: Path | None = None) -> dict[str, Any]:
    """Write chunk files 0..C-1 into `work_dir` from the shards in `source_dir`, in corpus order.

    Document ids: the corpus's (if given), else ``ids/N.txt`` (own layout), else "0".."N-1".
    Every chunk is rewritten (importing is I/O-bound and cheap next to encoding), so the
    caller should start from a clean work directory.
    -> {"documents", "vectors", "chunks", "shards", "d_cls", "d_bow", "layout",
        "bow_reduction", "score_weight", "source"}
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidParameterError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    source_dir = Path(source_dir)
    layout, shards, meta = scan_embeddings(source_dir)
    total = sum(s.documents for s in shards)
    log.info("%s: %s layout, %d shards, %d documents, CLS %d-d, BOW %d-d", source_dir, layout, len(shards), total,
             meta["d_cls"], meta["d_bow"])
    documents = iter_corpus(Path(corpus)) if corpus is not None else None
    written = vectors = 0
    chunk = -1
    for chunk, pieces in enumerate(_pieces(shards, chunk_size)):
        cls = np.concatenate([p[0] for p in pieces])
        bow = np.concatenate([p[1] for p in pieces])
        counts = np.concatenate([p[2] for p in pieces])
        shard_ids = [i for p in pieces for i in (p[3] or [])] if pieces[0][3] is not None else None
        titles: list[str] | None = None
        texts: list[str] | None = None
        if documents is not None:
            batch = [next(documents, None) for _ in range(len(counts))]
            if batch[-1] is None:
                have = written + sum(d is not None for d in batch)
                raise CorpusError(f"{corpus}: {have} documents, but the embeddings hold {total}")
            ids = [d.doc_id for d in batch]  # type: ignore[union-attr]
            titles = [d.title for d in batch]  # type: ignore[union-attr]
            texts = [d.text for d in batch]  # type: ignore[union-attr]
            if shard_ids is not None and shard_ids != ids:
                row = next(n for n, (a, b) in enumerate(zip(shard_ids, ids)) if a != b)
                raise CorpusError(f"{corpus}:{batch[row].line}: id {ids[row]!r} but the embeddings' "  # type: ignore[union-attr]
                                  f"document {written + row} has id {shard_ids[row]!r}")
        elif shard_ids is not None:
            ids = shard_ids
        else:
            ids = [str(n) for n in range(written, written + len(counts))]
        write_chunk(work_dir, chunk, cls, bow, counts, ids, titles, texts)
        written += len(counts)
        vectors += len(bow)
    if documents is not None and next(documents, None) is not None:
        raise CorpusError(f"{corpus}: more documents than the {total} the embeddings hold")
    if written != total:
        raise CorpusError(f"{corpus}: the embeddings hold {written} documents, their header {total}")
    return {
        "documents": written,
        "vectors": vectors,
        "chunks": chunk + 1,
        "shards": len(shards),
        "d_cls": int(meta["d_cls"]),
        "d_bow": int(meta["d_bow"]),
        "layout": layout,
        "bow_reduction": meta["bow_reduction"],
        "score_weight": meta["score_weight"],
        "source": str(source_dir.absolute()),
    }
