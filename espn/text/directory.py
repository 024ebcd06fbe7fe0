"""The full-text index of an index directory: built by the assembler from the passages it
just wrote, or added to an index built without one (`espn text-index INDEX`).

Both read the passages back from `docs.jsonl` (doc number = line), so the text side holds
exactly what the vectors hold, title and text, in the same numbering.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator


from espn.errors import IndexCorruptError, InvalidParameterError
from espn.mapped import map_npy
from ..params import HybridParams
from ..files.checksums import sha256_file
from ..files.durable import write_json_atomic
from ..index import read_manifest
from espn.generation.format import read_current
from espn.text.config import TextConfig
from espn.text.engine import TextDocument, build_text_index, engine_files

__all__ = ["passages", "build_for_directory", "add_text_index", "DEFAULT_HYBRID"]

log = logging.getLogger(__name__)

#: The hybrid defaults a new text index records in its manifest (`espn calibrate` refits mix_weight).
DEFAULT_HYBRID = HybridParams()


def passages(directory: Path) -> Iterator[TextDocument]:
    """(doc number, title, text) of every passage in `directory/docs.jsonl` (split by
    `docs_offsets.npy`), streamed; a hole (a deleted document a merge kept numbered, an
    empty line) has none."""
    offsets = map_npy(Path(directory) / "docs_offsets.npy")
    with open(Path(directory) / "docs.jsonl", "rb") as f:
        for number in range(len(offsets) - 1):
            line = f.read(int(offsets[number + 1] - offsets[number]))
            if line.strip():
                obj = json.loads(line)
                yield TextDocument(number, obj.get("title") or "", obj.get("text") or "")


def build_for_directory(directory: Path, config: TextConfig) -> dict[str, Any]:
    """Build `directory/text/` from the directory's passages; returns the manifest's `text` section."""
    started = time.perf_counter()
    section = build_text_index(Path(directory) / "text", passages(directory), config)
    section["build_s"] = round(time.perf_counter() - started, 3)
    log.info("full-text index of %d passages built in %.1fs", section["documents"], section["build_s"])
    return section


def add_text_index(root: Path, config: TextConfig, force: bool = False) -> dict[str, Any]:
    """Add a full-text index to an index built without one; returns its `text` section.

    The index's base gets `text/` (built beside it, then renamed into place) and its
    manifest the `text` and `hybrid` sections and the new files' checksums, in one atomic
    manifest write. A live index with delta segments is refused: compact it first.
    """
    root = Path(root)
    generation = read_current(root)
    if generation.segments:
        raise InvalidParameterError(f"{root}: generation {generation.number} has {len(generation.segments)} delta "
                                    "segment(s); run `espn compact` first, then add the text index")
    base = root / generation.base
    manifest = read_manifest(base)
    if manifest.get("text") is not None and "text/meta.json" in manifest["files"] and not force:
        raise InvalidParameterError(f"{base}: already has a full-text index (pass --force to rebuild it)")
    return install_text_index(base, config)


def install_text_index(base: Path, config: TextConfig) -> dict[str, Any]:
    """Build `base/text/` from the base's passages (beside it, then renamed into place) and
    record it in the base's manifest (section and files) in one atomic write."""
    manifest = read_manifest(base)
    if not (base / "docs.jsonl").is_file():
        raise IndexCorruptError(f"{base}: no docs.jsonl to index")
    staging = base / "text.partial"
    started = time.perf_counter()
    section = build_text_index(staging, passages(base), config)
    section["build_s"] = round(time.perf_counter() - started, 3)
    count = int(manifest["counts"]["documents"])
    if section["documents"] != count:
        shutil.rmtree(staging)
        raise IndexCorruptError(f"{base}: docs.jsonl holds {section['documents']} passages, the manifest {count}")
    target = base / "text"
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    files = {name: entry for name, entry in manifest["files"].items() if not name.startswith("text/")}
    for name in engine_files(target):
        path = target / name
        files[f"text/{name}"] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest.update(files=files, text=section, hybrid=manifest.get("hybrid") or DEFAULT_HYBRID.to_json())
    write_json_atomic(base / "manifest.json", manifest)
    log.info("%s: full-text index of %d passages added in %.1fs", base, count, section["build_s"])
    return section
