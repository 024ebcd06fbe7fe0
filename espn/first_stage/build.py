"""Build the token-level centroid first stage of an index directory (espn.first_stage.centroids).

Called by the build (assemble) for encoders without a trained CLS vector, or when asked
(`--first-stage centroids|union`), and by compaction's base rewrite so the new base's
centroid index covers exactly its documents. It reads the stored token vectors back from
embeddings.bin (what the re-rank scores, after pooling and int8), block by block.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from espn.encoders.base import reads_pages
from espn.errors import InvalidParameterError
from espn.first_stage.centroids import FirstStageConfig, build_token_centroids, wants_token_first_stage
from espn.params import FIRST_STAGE_KINDS
from espn.store import open_reader
from espn.store.format import StoreLayout

__all__ = ["DEFAULT_FIRST_STAGE", "PAGE_FIRST_STAGE", "default_first_stage", "first_stage_kind", "build_first_stage"]

#: What an index of a model without a trained CLS vector searches with unless told (chosen on
#: SciFact train queries, docs/benchmarks/first-stage.md).
DEFAULT_FIRST_STAGE = FirstStageConfig(kind="centroids", probe=8, candidates=256)
#: The same for an index of pages: each page holds ~1,030 near-alike patch vectors, and probe 8
#: falls to the 0.95 target of the exhaustive top 10 by 8,000 pages where probe 16 keeps 0.970
#: at no measured cost (the same 256 records read; docs/benchmarks/first-stage.md, "Pages").
PAGE_FIRST_STAGE = FirstStageConfig(kind="centroids", probe=16, candidates=256)


def default_first_stage(encoder_config: Mapping[str, Any]) -> FirstStageConfig:
    """The probe and candidates a new index starts with: the page default for an image encoder."""
    return PAGE_FIRST_STAGE if reads_pages(encoder_config) else DEFAULT_FIRST_STAGE


def first_stage_kind(requested: str | None, encoder_config: Mapping[str, Any]) -> str:
    """The first stage a build makes: the requested one, else centroids for encoders without a
    trained CLS vector, else the IVF alone."""
    if requested is not None:
        if requested not in FIRST_STAGE_KINDS:
            raise InvalidParameterError(f"first_stage must be one of {', '.join(FIRST_STAGE_KINDS)}, got {requested!r}")
        return requested
    return DEFAULT_FIRST_STAGE.kind if wants_token_first_stage(encoder_config) else "ivf"


def build_first_stage(directory: Path, records: np.ndarray, layout: StoreLayout, kind: str,
                      previous: Mapping[str, Any] | None = None, n_centroids: int | None = None,
                      defaults: FirstStageConfig = DEFAULT_FIRST_STAGE) -> dict[str, Any] | None:
    """Write `directory/first_stage/` for `kind` and return the manifest's `first_stage` section
    (None for "ivf": nothing to build). previous: the section of the index this one replaces
    (compaction), whose probe and candidates it keeps; else `defaults` (`default_first_stage`)."""
    if kind == "ivf":
        return None
    # The layout as stored: the records hold pooled vectors already (pooling is not applied twice).
    reader = open_reader("mmap", Path(directory) / "embeddings.bin", records, layout)  # type: ignore[arg-type]
    try:
        def vectors_of(numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            batch = reader.read(numbers)
            return batch.vectors.float().numpy(), batch.offsets

        built = build_token_centroids(Path(directory), vectors_of, len(records), int(records["n_bow"].sum()),
                                      n_centroids=n_centroids)
    finally:
        reader.close()
    base = FirstStageConfig.from_manifest(previous) if previous else defaults
    return {**base.to_json(), "kind": kind, "centroids": built["centroids"], "pairs": built["pairs"]}
