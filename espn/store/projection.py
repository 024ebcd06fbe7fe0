"""A base's projection of its token vectors: what an index created empty fits on its own documents.

An index built from a corpus fits its encoder's projection on a sample of that corpus before
anything is stored (espn.encoders.hf: an uncentred PCA of the token vectors, normalised again
after it). An index created empty has no corpus: it stores the model's own token vectors while it
is small, and the first base fitted on its own documents (espn.live.fitting) fits the same PCA on
the vectors it stores, projects them, and keeps the projection beside its records
(`projection.npy`, named by the store section). The model's vectors are normalised and the PCA is
uncentred, so projecting a stored vector gives what the encoder with that projection would have
given (up to the storage type's rounding).

It is fitted once: every base written after inherits it (its records are projected already, and
what the projection dropped is gone). What arrives in the model's dimensions afterwards (a write's
vectors, a query's) goes through it (`project`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..encoders.hf import uncentred_pca
from ..index import PROJECTION_FILE
from ..mapped import read_npy
from .format import StoreLayout
from .mmap import MmapReader
from .recode import CHUNK_DOCUMENTS, rewrite_records
from .sample import sample_records

__all__ = ["PROJECTION_FILE", "FIT_SAMPLE", "project", "base_projection", "projection_entry", "fit_projection"]

log = logging.getLogger(__name__)

#: The most token vectors the PCA is fitted on (whole documents, drawn at random).
FIT_SAMPLE = 1 << 18


def project(vectors: np.ndarray, projection: np.ndarray) -> np.ndarray:
    """Vectors [..., model dim] through `projection`, normalised again: float32 [..., stored dim].
    Zero vectors (a query's padding) stay zero."""
    projected = np.asarray(vectors, dtype=np.float32) @ projection
    norms = np.linalg.norm(projected, axis=-1, keepdims=True)
    return projected / np.maximum(norms, 1e-12)


def base_projection(directory: Path, store: Mapping[str, Any]) -> np.ndarray | None:
    """The projection of the base at `directory` (its manifest's store section), None without one."""
    name = store.get("projection")
    return None if name is None else read_npy(Path(directory) / str(name))


def projection_entry(directory: Path) -> dict[str, Any]:
    """The store section's entry for the base at `directory`: its projection file where it has one."""
    return {"projection": PROJECTION_FILE} if (Path(directory) / PROJECTION_FILE).is_file() else {}


def fit_projection(directory: Path, layout: StoreLayout, dim: int, seed: int = 1234) -> StoreLayout:
    """Fit a `dim`-d projection on a sample of the records of `directory` (written as `layout`, in
    the model's dimensions), save it as PROJECTION_FILE and rewrite embeddings.bin and records.npy
    with every record projected (each file replaced by rename, the projection first: a crash
    before the renames leaves the old records, which the manifest, written last, still describes).
    Returns the layout of the new records."""
    directory = Path(directory)
    records = read_npy(directory / "records.npy")
    reader = MmapReader(directory / "embeddings.bin", records, layout)
    try:
        sample = sample_records(reader, records, FIT_SAMPLE, seed, CHUNK_DOCUMENTS).astype(np.float64)
        sample /= np.maximum(np.linalg.norm(sample, axis=1, keepdims=True), 1e-12)
        projection = uncentred_pca(torch.from_numpy(sample.T @ sample / max(1, len(sample))), dim)
        np.save(directory / PROJECTION_FILE, projection)
        target = dataclasses.replace(layout, d_bow=dim)
        size = rewrite_records(directory, reader, records, target, lambda vectors: project(vectors, projection))
    finally:
        reader.close()
    log.info("records of %s projected %d -> %d on %d of their token vectors: %.1f MB", directory, layout.d_bow, dim,
             len(sample), size / 1e6)
    return target
