"""Encode stage for page corpora: page images -> chunk files, the same files the text build writes.

Pages come from `espn.pages.corpus.iter_pages` (a folder of images and PDFs, a PDF, or a JSONL of
`{"_id", "image"}` records), one at a time; they are cut into chunks of `chunk_size` pages in
corpus order, encoded `batch_size` at a time by the visual encoder (`encode_pages`) and
written with `indexing.chunks.write_chunk`. Reading, rendering and the processor run in a loader
worker process (`loader_workers=1`, as the text build tokenises), the model in this one. A chunk
already written is skipped (its pages are
still read, to keep the order, but not encoded), so a re-run after a crash resumes, and
`shard`/`num_shards` split the chunks round-robin between processes as for text.

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
from typing import Any, Iterator, Mapping, Protocol, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from tqdm import tqdm

from espn.encoders.base import DocumentEmbeddings
from espn.pages.grids import concat_grids
from espn.pages.images import encode_page_image
from espn.pages.corpus import DEFAULT_DPI, Page, iter_pages

from .chunks import finished_chunks, write_chunk
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
    """Reads, renders and preprocesses pages (in a loader worker), a batch at a time."""

    def __init__(self, corpus: Path, encoder: PageEncoder, dpi: int, chunk_size: int, batch_size: int, shard: int,
                 num_shards: int, done: frozenset[int], skip_bad: bool) -> None:
        super().__init__(chunk_size, batch_size, shard, num_shards, done)
        self.corpus, self.encoder, self.dpi, self.skip_bad = corpus, encoder, dpi, skip_bad

    def records(self) -> Iterator[Page]:
        return iter_pages(self.corpus, dpi=self.dpi, skip_bad=self.skip_bad)

    def batches(self, index: int, chunk: list[Page]) -> Iterator[dict[str, Any]]:
        # Batches in corpus order, no bucketing: a PDF's pages share a size (and so a patch count).
        starts = range(0, len(chunk), self.batch_size)
        for number, start in enumerate(starts):
            batch = chunk[start : start + self.batch_size]
            yield {
                "chunk": index,
                "features": self.encoder.preprocess_pages([page.image for page in batch]),
                "count": len(batch),
                "last": number == len(starts) - 1,
                # The stored image (espn.pages.images) is made here too, off the model's process.
                "meta": [(page.id, PurePosixPath(page.source).name, page_text(page), page_metadata(page),
                          encode_page_image(page.image)) for page in chunk] if number == 0 else None,
            }


def encode_page_corpus(corpus: Path, work_dir: Path, encoder: PageEncoder, *, dpi: int = DEFAULT_DPI,
                       chunk_size: int = 1024, batch_size: int = 8, shard: int = 0, num_shards: int = 1,
                       skip_bad: bool = False, loader_workers: int = 1, progress: bool = True,
                       total_pages: int | None = None) -> dict[str, int]:
    """Write this shard's missing chunk files; returns {"documents": N, "chunks": C} of the whole corpus.

    dpi: resolution PDFs are rendered at; loader_workers: 1 reads, renders and preprocesses pages in
    a worker process while this one runs the model (the same batches and vectors as 0, in-process);
    total_pages (`espn.pages.corpus.count_pages`) gives the progress bar its total, an upper bound where
    pages are skipped."""
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
    parts: list[DocumentEmbeddings] = []
    meta: list[tuple[str, str, str, dict[str, Any], bytes]] = []
    with tqdm(total=total, initial=initial, unit="page", unit_scale=True, desc=desc, disable=not progress,
              mininterval=1.0) as bar, worker_death_is_one_line():
        for item in loader:
            end = end_totals(item)
            if end is not None:
                totals = end
                break
            if item["meta"] is not None:
                parts, meta = [], item["meta"]
            parts.append(encoder.embed_pages(item["features"]))
            bar.update(int(item["count"]))
            if item["last"]:
                index = int(item["chunk"])
                cls, bow = np.concatenate([p.cls for p in parts]), np.concatenate([p.bow for p in parts])
                counts = np.concatenate([p.counts for p in parts])
                grids = concat_grids(parts)
                if len(counts) != len(meta):
                    raise RuntimeError(f"chunk {index}: {len(counts)} encoded pages for {len(meta)} ids")
                ids, titles, texts, metadata, images = zip(*meta)
                write_chunk(work_dir, index, cls, bow, counts, ids, titles, texts, metadata, images, grids)
                log.debug("chunk %d written (%d pages)", index, len(ids))
    return totals
