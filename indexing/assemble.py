"""Assemble stage: chunk files -> a finished index directory, published by an atomic rename.

Streams chunk by chunk into espn.live.base_segment's writer, the one every base goes through:
records straight into embeddings.bin, CLS vectors into a temporary fp16 memmap from which
espn.live.fitting fits the IVF (on a sample), the first stage and residual codes; the only
arrays sized by the corpus are numpy memmaps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from espn.corpus import PASSAGE_JOINER
from espn.encoders.base import reads_pages
from espn.errors import CorpusError, IndexExistsError
from espn.files.durable import fsync_path
from espn.index import FORMAT_VERSION, write_manifest
from espn.live.base_segment import BaseSegmentWriter
from espn.live.fitting import Fit
from espn.metadata import MetadataWriter, add_from_passages
from espn.pages.images import PageImagesWriter
from espn.partitioning import PartitionLayout, owners
from espn.store.format import StoreLayout
from espn.store.recode import require_centroid_stage, written_before_centroids

from espn.text.config import TextConfig

from espn.first_stage.build import default_first_stage, first_stage_kind
from espn.text.directory import DEFAULT_HYBRID, build_for_directory

from .chunks import Chunk, chunk_path, read_chunk
from .workdir import WorkDir

__all__ = ["assemble", "publish"]

log = logging.getLogger(__name__)


def _chunk_list(work: WorkDir) -> list[int]:
    markers = work.markers()
    if not markers:
        raise CorpusError(f"{work.path}: no shard has finished encoding; run `espn index` first")
    total = markers[0]["chunks"]
    num_shards = markers[0]["num_shards"]
    finished = {m["shard"] for m in markers if m["num_shards"] == num_shards}
    missing_shards = sorted(set(range(num_shards)) - finished)
    if missing_shards:
        raise CorpusError(
            f"{work.path}: shard(s) {', '.join(f'{s}/{num_shards}' for s in missing_shards)} not finished; "
            f"run `espn index ... --shard I/{num_shards}` for them"
        )
    if total == 0 or markers[0]["documents"] == 0:
        raise CorpusError(f"{work.job()['corpus']}: the corpus has no documents")
    chunks = list(range(total))
    absent = [c for c in chunks if not chunk_path(work.path, c).is_file()]
    if absent:
        raise CorpusError(f"{work.path}: chunk file(s) {absent[:5]} missing; re-run `espn index` to encode them")
    return chunks


def _mine(ids: np.ndarray, layout: PartitionLayout) -> np.ndarray:
    """Which of these documents (their ids) partition `layout.index` owns."""
    if layout.count == 1:
        return np.ones(len(ids), dtype=bool)
    return owners(ids, layout.count) == layout.index


def assemble(work: WorkDir, staging: Path, partition: int = 0, partitions: int = 1) -> dict[str, Any]:
    """Write a complete index into `staging` from the work dir's chunks.

    With `partitions` > 1 it takes the documents whose ids `espn.partitioning` places in
    `partition`: the rule the router follows for writes, recorded in the manifest.
    """
    partition_layout = PartitionLayout(partition, partitions)
    job = work.job()
    chunks = _chunk_list(work)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    encoder_config = job["encoder_config"]
    layout = StoreLayout(encoder_config["d_cls"], encoder_config["d_bow"], job["block_size"],
                         dtype=job.get("bow_dtype", "float16"), pool_factor=job.get("pool_factor", 1))
    stage_kind = first_stage_kind(job.get("first_stage"), encoder_config)
    require_centroid_stage(layout.dtype, stage_kind)
    n_docs, id_width = _count_documents(work, chunks, partition_layout, job["corpus"])
    started = time.perf_counter()
    first_layout = written_before_centroids(layout)  # residual records are coded once the centroids exist
    # A build has its whole corpus: it is fitted from the start (espn.live.fitting).
    fit = Fit(exact=False, stage=dataclasses.replace(default_first_stage(encoder_config), kind=stage_kind),
              dtype=layout.dtype, ann=job.get("ann", "flat"), pq_m=job.get("pq_m", 32), nlist=job.get("nlist"))
    with BaseSegmentWriter(staging, first_layout, n_docs, id_width, job["corpus"], groups_dir=staging) as base:
        written = _write_documents(work, chunks, staging, base, partition_layout)
        fitted = base.finish(fit, pool_factor=layout.pool_factor)
    shutil.copytree(work.encoder_dir, staging / "encoder")

    weight = job.get("w") if job.get("w") is not None else encoder_config.get("learned_weight")
    manifest = {
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "encoder": encoder_config,
        "counts": {"documents": n_docs, "bow_vectors": base.n_bow, "bow_vectors_encoded": written.n_encoded},
        "store": fitted["store"],
        "ann": fitted["ann"],
        "fit": fitted["fit"],
        "score": {"w": weight if weight is not None else 0.3,
                  "bow_reduction": encoder_config.get("bow_reduction", "mean"),
                  "calibrated": weight is not None},
        "search_defaults": fitted["search_defaults"],
        "partition": partition_layout.to_json(),
        "source": {"corpus": job["corpus"]},
        # How a title joins its text in the passages the encoder read (a build from before it
        # was recorded used PASSAGE_JOINER); `espn add` and explanations read it back
        # (espn.corpus.index_title_joiner).
        "passage": {"title_joiner": job.get("passage_joiner", PASSAGE_JOINER)},
    }
    if written.metadata is not None:
        manifest["metadata"] = written.metadata
    if fitted["first_stage"] is not None:
        manifest["first_stage"] = fitted["first_stage"]
    if job.get("text_index") is not None:
        manifest["text"] = build_for_directory(staging, TextConfig.from_json(job["text_index"]))
        manifest["hybrid"] = DEFAULT_HYBRID.to_json()
    manifest = write_manifest(staging, manifest)
    log.info("assembled %d documents (%d BOW vectors, %.1f MB) in %.1fs", n_docs, base.n_bow, fitted["store"]["file_bytes"] / 1e6,
             time.perf_counter() - started)
    return manifest


def _count_documents(work: WorkDir, chunks: list[int], partition_layout: PartitionLayout,
                     corpus: str) -> tuple[int, int]:
    """Pass 1 (headers only), the sizes of the memmaps: (documents in the partition, id width in bytes)."""
    n_docs, id_width = 0, 1
    for c in chunks:
        with np.load(chunk_path(work.path, c)) as z:
            n_docs += int(_mine(z["ids"], partition_layout).sum())
            id_width = max(id_width, z["ids"].dtype.itemsize)
    if n_docs == 0:
        raise CorpusError(f"{corpus}: the partition has no documents")
    return n_docs, id_width


@dataclasses.dataclass
class _Written:
    """What pass 2 leaves beside the base's own files: the vectors encoded (before pooling), the
    metadata section."""

    n_encoded: int
    metadata: dict[str, Any] | None


def _write_documents(work: WorkDir, chunks: list[int], staging: Path, base: BaseSegmentWriter,
                     partition_layout: PartitionLayout) -> _Written:
    """Pass 2, chunk by chunk: records, ids and passages into the base, metadata and page images
    beside them."""
    position = n_encoded = 0
    metadata = MetadataWriter(staging, base.n_docs)
    # A page index keeps each page's image beside its record (espn.pages.images); listed by write_manifest.
    images = PageImagesWriter(staging) if reads_pages(work.job()["encoder_config"]) else None
    for c in chunks:
        chunk = read_chunk(work.path, c)
        if partition_layout.count > 1:
            chunk = chunk.select(_mine(chunk.ids, partition_layout))
        base.append(chunk.cls, chunk.bow, chunk.counts)
        base.append_passages(chunk.ids, chunk.docs_blob.tobytes(), np.diff(chunk.docs_offsets))
        if images is not None and chunk.images_blob is not None and chunk.images_offsets is not None:
            images.append_blob(chunk.images_blob, np.diff(chunk.images_offsets), chunk.grids)
        elif images is not None:  # a chunk encoded before images were kept: its pages have none
            images.append_unknown(len(chunk))
        _add_metadata(metadata, chunk, position)
        position += len(chunk)
        n_encoded += int(chunk.counts.sum())
    if images is not None:
        images.finish()
    return _Written(n_encoded, metadata.finish())


def _add_metadata(writer: MetadataWriter, chunk: Chunk, first: int) -> None:
    """Metadata columns from the chunk's document lines (only chunks that carry any are parsed)."""
    if b'"metadata"' in chunk.docs_blob.tobytes():
        blob = chunk.docs_blob.tobytes()
        offsets = chunk.docs_offsets.tolist()
        add_from_passages(writer, (blob[a:b] for a, b in zip(offsets[:-1], offsets[1:])), first)


def publish(staging: Path, out: Path, force: bool) -> None:
    """Move a finished staging directory to `out` by rename; an old index is replaced only with force."""
    fsync_path(staging)
    if out.exists():
        if not force:
            raise IndexExistsError(f"{out} exists; pass --force to replace it")
        retired = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.replace(out, retired)
        os.replace(staging, out)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, out)
    fsync_path(out.parent)
