"""What a live index looks like from outside the writer: its counts and drift, and whether
this process could write it at all. Needs no lock."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from espn.index import read_manifest
from espn.generation.format import LIVE_DIR, read_current

__all__ = ["live_stats", "read_only_reason", "DRIFT_REBUILD"]

#: Above this many documents added since the encoder state was fitted (a fraction of the
#: base it was fitted on), `stats` recommends a rebuild.
DRIFT_REBUILD = 0.5


def live_stats(root: Path | str) -> dict[str, Any]:
    """Counts per segment, deleted documents, and drift: documents added since the encoder
    state (model, PCA, IVF centroids) was fitted, as a fraction of the base. Needs no lock."""
    root = Path(root)
    g = read_current(root)
    fitted_on = int(read_manifest(root)["counts"]["documents"])  # the first build fitted the encoder state
    carried = int(read_manifest(root / g.base).get("compacted", {}).get("added_since_fit", 0))
    added = carried + g.total - g.base_documents
    drift = added / max(1, fitted_on)
    return {"generation": g.number, "base_documents": g.base_documents, "delta_segments": len(g.segments),
            "delta_documents": g.total - g.base_documents, "deleted_or_replaced": g.deleted_count,
            "tombstone_files": len(g.tombstones), "live_documents": g.live_documents,
            "fitted_on_documents": fitted_on, "added_since_fit": added, "drift": round(drift, 4),
            "rebuild_recommended": drift > DRIFT_REBUILD}


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
