"""What a live index looks like from outside the writer: its counts, what its base was fitted
on and whether a re-fit runs, and whether this process could write it at all. Needs no lock."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from espn.index import read_manifest
from espn.generation.format import LIVE_DIR, read_current

from .progress import compaction_progress

__all__ = ["live_stats", "read_only_reason", "fit_status"]

#: The file the build of a created index was trained on before indexes were created empty: such
#: a base is fitted on text that is not the index's own until it is rewritten.
_LEGACY_SAMPLE = "sample_corpus.jsonl"


def fit_status(root: Path | str) -> dict[str, Any]:
    """What the current base was fitted on (exact or fitted, documents, when), the documents added
    since, and the re-fit (a base rewrite) running now and how far it got (None: none runs)."""
    root = Path(root)
    g = read_current(root)
    manifest = read_manifest(root / g.base)
    fit = manifest.get("fit") or {}
    fitted_on = int(fit.get("documents", manifest["counts"]["documents"]))
    legacy = not fit and Path(str(manifest.get("source", {}).get("corpus", ""))).name == _LEGACY_SAMPLE
    added = g.live_documents - fitted_on
    return {"exact": bool(fit.get("exact", False)), "fitted_on_documents": fitted_on, "fitted_at": fit.get("at"),
            "added_since_fit": added, "growth_since_fit": round(added / max(1, fitted_on), 4),
            "refit_running": compaction_progress(root / LIVE_DIR),
            "rebuild_recommended": legacy}


def live_stats(root: Path | str) -> dict[str, Any]:
    """Counts per segment, deleted documents, and the fit of the base (fit_status). Needs no lock."""
    root = Path(root)
    g = read_current(root)
    return {"generation": g.number, "base_documents": g.base_documents, "delta_segments": len(g.segments),
            "delta_documents": g.total - g.base_documents, "deleted_or_replaced": g.deleted_count,
            "tombstone_files": len(g.tombstones), "live_documents": g.live_documents, **fit_status(root)}


def read_only_reason(root: Path | str) -> str | None:
    """Why a writer could not write the index at `root` from this process (a read-only mount,
    no permission), or None when it can."""
    root = Path(root)
    current = read_current(root)
    live_dir = root / LIVE_DIR
    for target in (live_dir if live_dir.is_dir() else root, root / current.base / "embeddings.bin"):
        if os.statvfs(target).f_flag & os.ST_RDONLY:
            return f"{target} is on a read-only filesystem"
        if not os.access(target, os.W_OK):
            return f"{target} is not writable by this user"
    return None
