"""Encode stage for page corpora: page images -> chunk files, the same files the text build writes.

Pages come from `espn.pages.corpus.iter_pages` (a folder of images and PDFs, a PDF, or a JSONL of
`{"_id", "image"}` records), one at a time; they are cut into chunks of `chunk_size` pages in
corpus order, preprocessed and encoded by the visual encoder in groups of at most `batch_size`
pages and espn.pages.memory.MAX_GROUP_BYTES of pixels, and written with
`indexing.chunks.write_chunk`. Reading, rendering and the processor run in a loader worker
process (`loader_workers=1`, as the text build tokenises), the model in this one; a page's
pixels live only until its group is preprocessed, and a chunk's vectors and stored images are
spooled to files until the chunk is written (`_ChunkSpool`), so memory grows with neither the
chunk size nor the corpus. A chunk already written is skipped (its pages are still read, to
keep the order, but not encoded), so a re-run after a crash resumes, and `shard`/`num_shards`
split the chunks round-robin between processes as for text.

Each page's stored text is a short description ("page 3 of reports/a.pdf"), its title the
source file's name, and its metadata the record's with `source` and `page` added (the
record's own values win). Its image is kept too, bounded and re-encoded
(`espn.pages.images.encode_page_image`, in the loader worker), in the chunk and then the index.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Iterator, Mapping, Protocol, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from tqdm import tqdm

from espn.encoders.base import DocumentEmbeddings
from espn.pages.grids import concat_grids
from espn.pages.images import encode_page_image
from espn.pages.corpus import DEFAULT_DPI, Page, iter_pages
from espn.pages.memory import MAX_GROUP_BYTES, page_cost

from .chunks import chunk_path, finished_chunks, write_chunk
from .encode import worker_death_is_one_line  # the text build's, shared
from .encode import ShardBatches, die_with_parent, end_totals

__all__ = ["PageEncoder", "encode_page_corpus", "page_text", "page_metadata"]

log = logging.getLogger(__name__)


class PageEncoder(Protocol):
    """What the page build needs of an encoder (espn.encoders.visual.VisualEncoder): `preprocess_pages`
    runs in the loader worker (picklable output), `embed_pages` on its output in this process."""

    def preprocess_pages(self, images: Sequence[Image.Image]) -> Mapping[str, Any]: ...

    def embed_pages(self, features: Mapping[str, Any]) -> DocumentEmbeddings: ...


def page_text(page: Page) -> str:
    """The stored text of a page: where it comes from, for results and the full-text index."""
    return f"page {page.page_number} of {page.source}"


def page_metadata(page: Page) -> dict[str, Any]:
    """The record's metadata with `source` (the file, relative to the corpus root) and `page`
    (1-based) added where the record has no such field."""
    return {"source": page.source, "page": page.page_number, **page.metadata}


class _PreparedPages(ShardBatches):
    """Reads, renders and preprocesses pages (in a loader worker), a group at a time: a page's pixels
    live only until its group is preprocessed and its stored image made."""

    def __init__(self, corpus: Path, encoder: PageEncoder, dpi: int, chunk_size: int, batch_size: int, shard: int,
                 num_shards: int, done: frozenset[int], skip_bad: bool) -> None:
        super().__init__(chunk_size, batch_size, shard, num_shards, done)
        self.corpus, self.encoder, self.dpi, self.skip_bad = corpus, encoder, dpi, skip_bad

    def records(self) -> Iterator[Page]:
        return iter_pages(self.corpus, dpi=self.dpi, skip_bad=self.skip_bad)

    def batches(self, index: int, chunk: Iterator[Page]) -> Iterator[dict[str, Any]]:
        # Groups in corpus order, no bucketing (a PDF's pages share a size, and so a patch count), of
        # at most batch_size pages and MAX_GROUP_BYTES of decoded pixels (espn.pages.memory).
        group: list[Page] = []
        held = 0
        for page in chunk:
            cost = page_cost(*page.image.size)
            if group and (len(group) == self.batch_size or held + cost > MAX_GROUP_BYTES):
                item, group, held = self._item(index, group, last=False), [], 0
                yield item
            group.append(page)
            held += cost
        yield self._item(index, group, last=True)  # a chunk has a page at least

    def _item(self, index: int, group: list[Page], last: bool) -> dict[str, Any]:
        return {
            "chunk": index,
            "features": self.encoder.preprocess_pages([page.image for page in group]),
            "count": len(group),
            "last": last,
            "meta": [(page.id, PurePosixPath(page.source).name, page_text(page), page_metadata(page)) for page in group],
            # The stored image (espn.pages.images) is made here too, off the model's process.
            "images": [encode_page_image(page.image) for page in group],
        }


class _ChunkSpool:
    """One chunk's encoded pages as their groups come: the vectors (float16, as chunk files keep
    them) and stored images appended to files beside the chunk, the ids, texts and metadata in
    memory; `write` makes the chunk file from memory maps of them and removes them. So the model's
    process holds no chunk of vectors or images, whatever the chunk size."""

    def __init__(self, work_dir: Path, index: int) -> None:
        self.work_dir, self.index = work_dir, index
        stem = chunk_path(work_dir, index)
        stem.parent.mkdir(parents=True, exist_ok=True)
        self.paths = [stem.with_name(f"{stem.stem}.{part}.tmp") for part in ("cls", "bow", "images")]
        self.files: list[BinaryIO] = []
        try:
            for path in self.paths:
                self.files.append(open(path, "wb"))
        except BaseException:
            self.discard()
            raise
        self.counts: list[np.ndarray] = []
        self.grids: list[np.ndarray] = []
        self.meta: list[tuple[str, str, str, dict[str, Any]]] = []
        self.image_lengths: list[int] = []
        self.widths = (0, 0)

    def add(self, embeddings: DocumentEmbeddings, meta: list[tuple[str, str, str, dict[str, Any]]],
            images: list[bytes]) -> None:
        cls_file, bow_file, image_file = self.files
        cls_file.write(np.ascontiguousarray(embeddings.cls, dtype=np.float16).tobytes())
        bow_file.write(np.ascontiguousarray(embeddings.bow, dtype=np.float16).tobytes())
        for image in images:
            image_file.write(image)
        self.widths = (embeddings.cls.shape[1], embeddings.bow.shape[1])
        self.counts.append(np.asarray(embeddings.counts, dtype=np.int32))
        self.grids.append(concat_grids([embeddings]))
        self.meta += meta
        self.image_lengths += [len(image) for image in images]

    def write(self) -> None:
        """The chunk file, written atomically (indexing.chunks.write_chunk); the spooled files go."""
        for f in self.files:
            f.close()
        counts = np.concatenate(self.counts)
        if len(counts) != len(self.meta):
            raise RuntimeError(f"chunk {self.index}: {len(counts)} encoded pages for {len(self.meta)} ids")
        cls = _mapped(self.paths[0], np.float16, (len(counts), self.widths[0]))
        bow = _mapped(self.paths[1], np.float16, (int(counts.sum()), self.widths[1]))
        blob = _mapped(self.paths[2], np.uint8, (sum(self.image_lengths),))
        offsets = np.zeros(len(self.image_lengths) + 1, dtype=np.int64)
        np.cumsum(self.image_lengths, out=offsets[1:])
        ids, titles, texts, metadata = zip(*self.meta)
        write_chunk(self.work_dir, self.index, cls, bow, counts, ids, titles, texts, metadata,
                    grids=np.concatenate(self.grids), packed_images=(blob, offsets))
        del cls, bow, blob
        self.discard()
        log.debug("chunk %d written (%d pages)", self.index, len(ids))

    def discard(self) -> None:
        for f, path in zip(self.files, self.paths):
            f.close()
            path.unlink(missing_ok=True)


def _mapped(path: Path, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    """`path` as a read-only array of `shape` (an empty one for an empty file, which mmap refuses)."""
    if not int(np.prod(shape)):
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


def encode_page_corpus(corpus: Path, work_dir: Path, encoder: PageEncoder, *, dpi: int = DEFAULT_DPI,
                       chunk_size: int = 1024, batch_size: int = 8, shard: int = 0, num_shards: int = 1,
                       skip_bad: bool = False, loader_workers: int = 1, progress: bool = True,
                       total_pages: int | None = None) -> dict[str, int]:
    """Write this shard's missing chunk files; returns {"documents": N, "chunks": C} of the whole corpus.

    dpi: resolution PDFs are rendered at; loader_workers: 1 reads, renders and preprocesses pages in
    a worker process while this one runs the model (the same batches and vectors as 0, in-process);
    total_pages (`espn.pages.corpus.count_pages`) gives the progress bar its total, an upper bound where
    pages are skipped. Memory does not grow with the chunk size: the loader holds one group of pages
    (espn.pages.memory.MAX_GROUP_BYTES), this process one group's vectors (`_ChunkSpool`)."""
    done = frozenset(finished_chunks(work_dir))
    dataset = _PreparedPages(Path(corpus), encoder, dpi, chunk_size, batch_size, shard, num_shards, done, skip_bad)
    cuda = torch.cuda.is_available() and str(getattr(encoder, "device", "cpu")).startswith("cuda")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # fast tokenizers deadlock-warn after fork
    loader = DataLoader(dataset, batch_size=None, num_workers=loader_workers, pin_memory=cuda,
                        prefetch_factor=4 if loader_workers else None, persistent_workers=False,
                        worker_init_fn=functools.partial(die_with_parent, os.getpid()) if loader_workers else None)
    total, initial = dataset.progress(total_pages)
    desc = "encode pages" if num_shards == 1 else f"encode pages, shard {shard + 1} of {num_shards}"
    totals = {"documents": 0, "chunks": 0}
    spool: _ChunkSpool | None = None
    with tqdm(total=total, initial=initial, unit="page", unit_scale=True, desc=desc, disable=not progress,
              mininterval=1.0) as bar, worker_death_is_one_line():
        try:
            for item in loader:
                end = end_totals(item)
                if end is not None:
                    totals = end
                    break
                if spool is None:
                    spool = _ChunkSpool(work_dir, int(item["chunk"]))
                spool.add(encoder.embed_pages(item["features"]), item["meta"], item["images"])
                bar.update(int(item["count"]))
                if item["last"]:
                    spool.write()
                    spool = None
        finally:
            if spool is not None:  # an error or an interrupt: the chunk was never written
                spool.discard()
    return totals
