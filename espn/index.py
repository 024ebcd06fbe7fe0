"""The index directory: manifest, file names, checksums, and the numpy-backed id map and text store.

Everything opened here is memory-mapped (records, ids, text offsets), so worker
processes that open one index share one copy of it in the page cache; the maps hold no
file descriptor (`espn.mapped`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from .errors import DocumentNotFoundError, IndexCorruptError
from .files.checksums import sha256_file
from .files.durable import write_json_atomic
from .mapped import map_npy
from .results import Document

__all__ = [
    "encoder_label",
    "FORMAT_VERSION",
    "FILES",
    "OPTIONAL_FILES",
    "POOL_GROUP_FILES",
    "PAGE_IMAGE_FILES",
    "IndexDirectory",
    "IdMap",
    "DocStore",
    "write_manifest",
    "read_manifest",
]

#: Format 2 adds the int8 storage type and pooled records (`store.dtype`, `store.pool_factor`);
#: format 1 indexes (fp16, unpooled) read as before.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
#: Files every index holds (besides encoder/, which is checksummed file by file).
FILES = ("ann.faiss", "embeddings.bin", "records.npy", "ids.npy", "ids_sorted.npy", "docs.jsonl", "docs_offsets.npy")
#: The pooling groups of pooled records (written by espn.pooling.groups).
GROUPS_FILE = "pool_groups.npy"
GROUP_OFFSETS_FILE = "pool_groups_offsets.npy"
POOL_GROUP_FILES = (GROUPS_FILE, GROUP_OFFSETS_FILE)
#: The stored pages of a page index and their patch grids (written by espn.pages.images).
IMAGES_FILE = "page_images.bin"
IMAGE_OFFSETS_FILE = "page_images_offsets.npy"
GRIDS_FILE = "page_grids.npy"
PAGE_IMAGE_FILES = (IMAGES_FILE, IMAGE_OFFSETS_FILE, GRIDS_FILE)
#: The projection of the stored token vectors of an index created empty (espn.store.projection).
PROJECTION_FILE = "projection.npy"
#: Files an index holds where it has them, checksummed like the others: the pooling groups
#: of pooled records (espn.pooling.groups), the page images of a page index (espn.pages.images),
#: the projection a created index fitted on its own documents (espn.store.projection).
#: Added within format 2: an index without them explains by re-encoding (has no images), and an
#: older espn opens an index with them.
OPTIONAL_FILES = (*POOL_GROUP_FILES, *PAGE_IMAGE_FILES, PROJECTION_FILE)
#: Below this total size `verify="auto"` hashes every file on open; above it only sizes
#: and the small files (hashing tens of GB at every start would take minutes).
FULL_VERIFY_LIMIT = 2 << 30


def _index_files(directory: Path) -> list[str]:
    names = [name for name in (*FILES, *OPTIONAL_FILES) if (directory / name).exists()]
    # metadata/: per-field columns (espn.metadata); first_stage/: the token centroid index
    # (espn.first_stage.centroids); text/: the full-text index (espn.text), whose
    # engine lock files (dot files) are not part of the index
    for folder in ("encoder", "metadata", "text", "first_stage"):
        if (directory / folder).is_dir():
            names += sorted(str(p.relative_to(directory)) for p in (directory / folder).rglob("*")
                            if p.is_file() and not p.name.startswith("."))
    return names


def write_manifest(directory: Path, manifest: Mapping[str, Any],
                   known: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Add size and sha256 of every file, then write manifest.json atomically (fsynced).
    known: the entries of files whose checksums were taken already (immutable files linked in,
    such as a saved encoder's), used when their sizes still agree."""
    directory = Path(directory)
    known = known or {}
    full = dict(manifest)
    full["format_version"] = FORMAT_VERSION
    full["files"] = {}
    for name in _index_files(directory):
        size = (directory / name).stat().st_size
        entry = known.get(name)
        full["files"][name] = dict(entry) if entry is not None and entry["bytes"] == size else \
            {"bytes": size, "sha256": sha256_file(directory / name)}
    write_json_atomic(directory / MANIFEST, full)
    return full


def update_manifest(directory: Path, **sections: Any) -> dict[str, Any]:
    """Rewrite manifest sections (e.g. a calibrated score weight) keeping the file checksums."""
    manifest = read_manifest(directory)
    manifest.update(sections)
    write_json_atomic(Path(directory) / MANIFEST, manifest)
    return manifest


def encoder_label(directory: Path | str) -> str:
    """The index's encoder as `kind:name` (e.g. hf:all-MiniLM-L6-v2); "unknown" when its manifest
    cannot be read (a listing of indexes never fails on one)."""
    try:
        entry = read_manifest(Path(directory))["encoder"]
        return f"{entry.get('kind', '?')}:{entry.get('name', '?')}"
    except (IndexCorruptError, OSError, KeyError, TypeError, AttributeError):
        return "unknown"


def read_manifest(directory: Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise IndexCorruptError(f"{directory}: not an espn index (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise IndexCorruptError(f"{path}: unreadable manifest ({exc})") from None
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS:
        raise IndexCorruptError(f"{path}: index format {version!r}, this espn reads formats "
                                f"{', '.join(map(str, READABLE_VERSIONS))} (upgrade espn, or rebuild the index)")
    return manifest


class IndexDirectory:
    """An opened, validated index directory."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = Path(path)
        self.manifest = manifest

    @classmethod
    def open(cls, path: Path | str, verify: str = "auto", appended: frozenset[str] = frozenset()) -> "IndexDirectory":
        """Validate against the manifest. verify: "full" (sha256 of all), "fast" (sizes, and
        sha256 of files under 64 MiB), "auto" (full below 2 GiB), "none".

        appended: files a live index appends to (embeddings.bin): they may be longer than the
        manifest says, and only the bytes it lists are checked (espn.generation.segments checks the rest).
        """
        path = Path(path)
        if not path.is_dir():
            raise IndexCorruptError(f"{path}: no such index directory")
        manifest = read_manifest(path)
        files: dict[str, dict[str, Any]] = manifest.get("files", {})
        missing = [name for name in FILES if name not in files]
        if missing:
            raise IndexCorruptError(f"{path}: manifest lists no {', '.join(missing)}")
        if verify not in ("full", "fast", "auto", "none"):
            raise ValueError(f"verify must be full, fast, auto or none, got {verify!r}")
        if verify == "auto":
            verify = "full" if sum(f["bytes"] for f in files.values()) <= FULL_VERIFY_LIMIT else "fast"
        if verify != "none":
            for name, expected in files.items():
                file = path / name
                if not file.is_file():
                    raise IndexCorruptError(f"{file}: missing")
                size = file.stat().st_size
                grown = name in appended and size > expected["bytes"]
                if size != expected["bytes"] and not grown:
                    raise IndexCorruptError(f"{file}: {size} bytes, the manifest says {expected['bytes']} (truncated?)")
                stop = expected["bytes"] if grown else None
                if (verify == "full" or expected["bytes"] < 64 << 20) and sha256_file(file, 0, stop) != expected["sha256"]:
                    raise IndexCorruptError(f"{file}: checksum mismatch (corrupted)")
        return cls(path, manifest)

    def file(self, name: str) -> Path:
        return self.path / name

    def load_array(self, name: str) -> np.ndarray:
        """A read-only memory map of `name` that holds no file descriptor (espn.mapped)."""
        try:
            return map_npy(self.path / name)
        except (ValueError, OSError) as exc:
            raise IndexCorruptError(f"{self.path / name}: unreadable ({exc})") from None

    @property
    def num_documents(self) -> int:
        return int(self.manifest["counts"]["documents"])


class IdMap:
    """External id <-> internal doc number, backed by two memory-mapped arrays.

    ids [N] fixed-width utf-8 bytes; order [N] int64 sorts them, for binary search.
    """

    def __init__(self, ids: np.ndarray, order: np.ndarray) -> None:
        self.ids, self.order = ids, order

    def external(self, doc_numbers: Iterable[int]) -> list[str]:
        """The ids of `doc_numbers`: one gather of the fixed-width bytes, then a decode each
        (3x faster than an indexing per id: the hits of every search go through here)."""
        numbers = doc_numbers if isinstance(doc_numbers, np.ndarray) else np.fromiter(doc_numbers, dtype=np.int64)
        return [raw.decode("utf-8") for raw in self.ids[numbers].tolist()]

    def internal(self, doc_id: str) -> int:
        """Binary search over `order`: O(log N) memory-mapped lookups, no sorted copy in RAM."""
        raw = doc_id.encode("utf-8")
        if not raw or len(raw) > self.ids.dtype.itemsize:
            raise DocumentNotFoundError(f"no document with id {doc_id!r}")
        key = np.bytes_(raw)
        low, high = 0, len(self.order)
        while low < high:
            mid = (low + high) // 2
            if self.ids[self.order[mid]] < key:
                low = mid + 1
            else:
                high = mid
        if low < len(self.order) and self.ids[self.order[low]] == key:
            return int(self.order[low])
        raise DocumentNotFoundError(f"no document with id {doc_id!r}")


class DocStore:
    """Passage text read by offset on demand: docs.jsonl plus docs_offsets [N+1] int64."""

    def __init__(self, path: Path, offsets: np.ndarray) -> None:
        self.path, self.offsets = Path(path), offsets

    def _line(self, doc_number: int) -> dict[str, Any]:
        start, end = int(self.offsets[doc_number]), int(self.offsets[doc_number + 1])
        with open(self.path, "rb") as f:
            f.seek(start)
            return dict(json.loads(f.read(end - start)))

    def get(self, doc_number: int) -> tuple[str, str]:
        obj = self._line(doc_number)
        return obj.get("title", ""), obj.get("text", "")

    def document(self, doc_id: str, doc_number: int) -> Document:
        """The passage with the metadata object stored beside it ({} when none)."""
        obj = self._line(doc_number)
        return Document(doc_id=doc_id, title=obj.get("title", ""), text=obj.get("text", ""),
                        metadata=dict(obj.get("metadata") or {}))
