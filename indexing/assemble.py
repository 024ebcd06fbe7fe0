"""Assemble stage: chunk files -> a finished index directory, published by an atomic rename.

Streams chunk by chunk: records go straight into embeddings.bin, CLS vectors into
a temporary fp16 memmap from which espn.live.fitting fits the IVF (on a sample), the first
stage and residual codes, as it does for every base; the only arrays sized by the corpus are
numpy memmaps.
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
from espn.live.fitting import CLS_TABLE, Fit, fit_base
from espn.metadata import MetadataWriter, add_from_passages
from espn.pages.images import PageImagesWriter
from espn.partitioning import PartitionLayout, owners
from espn.store.format import RECORD_DTYPE, RecordWriter, StoreLayout, stored_cls
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
    written = _write_records(work, chunks, staging, first_layout, n_docs, id_width, partition_layout)
    _write_id_order(staging, written.ids, job["corpus"])
    # A build has its whole corpus: it is fitted from the start (espn.live.fitting).
    fit = Fit(exact=False, stage=dataclasses.replace(default_first_stage(encoder_config), kind=stage_kind),
              dtype=layout.dtype, ann=job.get("ann", "flat"), pq_m=job.get("pq_m", 32), nlist=job.get("nlist"))
    fitted = fit_base(staging, first_layout, n_docs, fit, pool_factor=layout.pool_factor)
    shutil.copytree(work.encoder_dir, staging / "encoder")

    weight = job.get("w") if job.get("w") is not None else encoder_config.get("learned_weight")
    manifest = {
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "encoder": encoder_config,
        "counts": {"documents": n_docs, "bow_vectors": written.n_bow, "bow_vectors_encoded": written.n_encoded},
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
    log.info("assembled %d documents (%d BOW vectors, %.1f MB) in %.1fs", n_docs, written.n_bow, fitted["store"]["file_bytes"] / 1e6,
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
    """What pass 2 leaves: the ids memmap (in row order), the vector counts, the metadata section."""

    ids: np.ndarray
    n_bow: int
    n_encoded: int
    metadata: dict[str, Any] | None


def _write_records(work: WorkDir, chunks: list[int], staging: Path, layout: StoreLayout, n_docs: int, id_width: int,
                   partition_layout: PartitionLayout) -> _Written:
    """Pass 2: records into embeddings.bin, ids, document lines and offsets, metadata, and the
    CLS vectors into cls.tmp.npy (the ANN's input), chunk by chunk."""
    records = np.lib.format.open_memmap(staging / "records.npy", mode="w+", dtype=RECORD_DTYPE, shape=(n_docs,))
    ids = np.lib.format.open_memmap(staging / "ids.npy", mode="w+", dtype=f"S{id_width}", shape=(n_docs,))
    docs_offsets = np.lib.format.open_memmap(staging / "docs_offsets.npy", mode="w+", dtype=np.int64, shape=(n_docs + 1,))
    cls_tmp = np.lib.format.open_memmap(staging / CLS_TABLE, mode="w+", dtype=np.float16, shape=(n_docs, layout.d_cls))
    docs_offsets[0] = 0
    position = n_bow = n_encoded = 0
    metadata = MetadataWriter(staging, n_docs)
    # A page index keeps each page's image beside its record (espn.pages.images); listed by write_manifest.
    images = PageImagesWriter(staging) if reads_pages(work.job()["encoder_config"]) else None
    with RecordWriter(staging / "embeddings.bin", layout, groups_dir=staging) as writer, \
            open(staging / "docs.jsonl", "wb") as docs:
        for c in chunks:
            chunk = read_chunk(work.path, c)
            if partition_layout.count > 1:
                chunk = chunk.select(_mine(chunk.ids, partition_layout))
            rows = slice(position, position + len(chunk))
            written = writer.append(chunk.cls, chunk.bow, chunk.counts)
            records[rows] = written
            ids[rows] = chunk.ids
            cls_tmp[rows] = stored_cls(chunk.cls, layout)  # the IVF is fitted on the CLS as stored
            docs.write(chunk.docs_blob.tobytes())
            if images is not None and chunk.images_blob is not None and chunk.images_offsets is not None:
                images.append_blob(chunk.images_blob, np.diff(chunk.images_offsets), chunk.grids)
            elif images is not None:  # a chunk encoded before images were kept: its pages have none
                images.append_unknown(len(chunk))
            _add_metadata(metadata, chunk, position)
            docs_offsets[position + 1 : position + len(chunk) + 1] = docs_offsets[position] + chunk.docs_offsets[1:]
            position += len(chunk)
            n_bow += int(written["n_bow"].sum())
            n_encoded += int(chunk.counts.sum())
        writer.close()
        docs.flush()
        os.fsync(docs.fileno())
    if images is not None:
        images.finish()
    for array in (records, ids, docs_offsets, cls_tmp):
        array.flush()
    return _Written(ids, n_bow, n_encoded, metadata.finish())


def _write_id_order(staging: Path, ids: np.ndarray, corpus: str) -> None:
    """ids_sorted.npy, the rows in id order; a duplicate id is refused naming both documents."""
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    dup = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
    if len(dup):
        first = int(dup[0])
        raise CorpusError(
            f"{corpus}: duplicate document id {bytes(sorted_ids[first]).decode()!r} "
            f"(documents #{int(order[first]) + 1} and #{int(order[first + 1]) + 1}); ids must be unique"
        )
    np.save(staging / "ids_sorted.npy", order)


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
