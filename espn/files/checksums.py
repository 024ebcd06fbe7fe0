"""Checksums of files: what a manifest, a generation or a snapshot records of each file it
names, and what a reader verifies before it trusts one (a model's weights, a downloaded part)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

__all__ = ["sha256_file", "file_entry"]


def sha256_file(path: Path, start: int = 0, stop: int | None = None) -> str:
    """sha256 of the file, or of its bytes [start, stop) (a live index's appended ranges)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = None if stop is None else stop - start
        while left is None or left > 0:
            block = f.read(1 << 22 if left is None else min(1 << 22, left))
            if not block:
                break
            digest.update(block)
            if left is not None:
                left -= len(block)
    return digest.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """A manifest's or generation's entry for a file: {"bytes", "sha256"}."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
