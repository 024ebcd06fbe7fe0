"""Rewrite an index's records as residual records once its centroids exist.

Residual records (`espn.store.residual`) code each token against the first stage's centroids,
which are trained from the stored vectors themselves (`espn.first_stage.build`). So a build
or a compaction that asks for them writes int8 records first, trains the centroids on those,
and then re-encodes every record here against the new centroids, in the file's own order
(the IVF-list order stays). The int8 error is ~100x below a 4-bit residual's, so coding from
int8 rather than from the encoder's vectors costs nothing measurable.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import InvalidParameterError
from ..mapped import read_npy
from .format import RecordWriter, StoreLayout
from .mmap import MmapReader
from .reader import Reader
from .residual import TRAIN_SAMPLE, residual_bits, train_codec
from .sample import sample_records

__all__ = ["recode_residual", "rewrite_records", "written_before_centroids", "require_centroid_stage", "CHUNK_DOCUMENTS"]

log = logging.getLogger(__name__)

#: Documents read and re-encoded per step: bounds the memory of the pass.
CHUNK_DOCUMENTS = 4096


def require_centroid_stage(dtype: str, first_stage: str) -> None:
    """Refuse residual records without the centroid first stage they are coded against."""
    if residual_bits(dtype) and first_stage == "ivf":
        raise InvalidParameterError(f"--bow-dtype {dtype} codes vectors against the centroid first stage, and this "
                                    "build has none: add --first-stage centroids (or union)")


def written_before_centroids(layout: StoreLayout) -> StoreLayout:
    """What a build writes before its centroids exist: int8 in place of residual records."""
    return dataclasses.replace(layout, dtype="int8", codec=None) if layout.bits else layout


def recode_residual(directory: Path, layout: StoreLayout, dtype: str, seed: int = 1234) -> tuple[StoreLayout, int]:
    """Rewrite `directory`'s embeddings.bin (records of `layout`) as `dtype` residual records
    against its first_stage/centroids.npy, and records.npy to match, each replaced by rename.

    Returns (the layout of the new records, with its codec; the new file size). The codec's
    files are written into first_stage/ first: a crash before the renames leaves the old
    records, still described by the manifest, which the caller writes last.
    """
    directory = Path(directory)
    bits = residual_bits(dtype)
    if not bits:
        raise ValueError(f"{dtype!r} is not a residual storage type")
    folder = directory / "first_stage"
    centroids = read_npy(folder / "centroids.npy")
    records = read_npy(directory / "records.npy")
    reader = MmapReader(directory / "embeddings.bin", records, layout)
    try:
        sample = sample_records(reader, records, TRAIN_SAMPLE, seed, CHUNK_DOCUMENTS)
        codec = train_codec(centroids, sample, bits)
        codec.save(folder)
        # the vectors are pooled already: the writer stores them as they are
        target = dataclasses.replace(layout, dtype=dtype, pool_factor=1, codec=codec)
        size = rewrite_records(directory, reader, records, target)
    finally:
        reader.close()
    log.info("records of %s recoded as %s: %.1f MB (%d centroids, normalized: %s)", directory, dtype, size / 1e6,
             len(centroids), codec.normalize)
    return dataclasses.replace(target, pool_factor=layout.pool_factor), size



def rewrite_records(directory: Path, reader: Reader, records: np.ndarray, target: StoreLayout,
                    convert: Callable[[np.ndarray], np.ndarray] | None = None) -> int:
    """Every record `reader` reads written again as `target` stores it (its BOW vectors through
    `convert` first), in the file's own order (the IVF-list order stays); then embeddings.bin and
    records.npy are replaced, each by rename once written and synced. Returns the new file size."""
    order = np.argsort(records["offset"], kind="stable")
    rewritten = records.copy()
    staged = directory / "embeddings.bin.rewritten"
    with RecordWriter(staged, target) as writer:
        for at in range(0, len(order), CHUNK_DOCUMENTS):
            batch = reader.read(order[at:at + CHUNK_DOCUMENTS])
            vectors = batch.vectors.float().numpy()
            rewritten[batch.docs] = writer.append(batch.cls.float().numpy(), vectors if convert is None else
                                                  convert(vectors), np.diff(batch.offsets))
        size = writer.close()
    staged_records = directory / "records.npy.rewritten"
    with open(staged_records, "wb") as file:
        np.save(file, rewritten)
        file.flush()
        os.fsync(file.fileno())
    os.replace(staged, directory / "embeddings.bin")
    os.replace(staged_records, directory / "records.npy")
    return size
