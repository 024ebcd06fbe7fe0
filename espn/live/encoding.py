"""Documents encoded in memory for a write: what the writer stores as a delta segment.

`encode_documents` is the online path (a few documents, this thread, no corpus or chunk
files); the offline build (espn_indexing.encode) encodes a corpus through a DataLoader and
shares `reorder_chunk` with it, so a write and a build of the same text store the same records.
"""

from __future__ import annotations

import dataclasses
import io
import threading
from typing import Any, Mapping, Sequence

import numpy as np
from PIL import Image

from espn.corpus import PASSAGE_JOINER, passage_line, passage_text
from espn.encoders import DocumentEmbeddings, Encoder
from espn.errors import CorpusError, InvalidParameterError
from espn.pages.grids import concat_grids
from espn.pages.images import UPLOAD_SUFFIXES, encode_page_image, media_type
from espn.pages.decode import MAX_IMAGE_BYTES, SIGNATURE_BYTES, decode_image, open_image, sniff_kind
from espn.pages.memory import PageMemory, bounded_groups, page_cost, process_page_memory

__all__ = ["EncodedDocuments", "encode_documents", "encode_page_documents", "decode_page_bytes", "page_header",
           "reorder_chunk", "PAGE_BATCH_SIZE", "documents_encoded"]

#: Pages a write decodes and the model encodes together at most (fewer where their pixels are
#: over espn.pages.memory.MAX_GROUP_BYTES).
PAGE_BATCH_SIZE = 8

_encoded = [0]  # documents this process has run through an encoder (the write path, a warm-up)
_encoded_lock = threading.Lock()


def documents_encoded() -> int:
    """How many documents this process has encoded for writes: what a reshard must leave unchanged
    (it copies stored records; a writer reports this in its status)."""
    return _encoded[0]


def _count(documents: int) -> None:
    with _encoded_lock:
        _encoded[0] += documents


@dataclasses.dataclass
class EncodedDocuments:
    """Documents encoded in memory, ready to become a delta segment.

    ids [n] external ids; lines [n] their docs.jsonl lines (utf-8); cls [n, d_cls] and
    bow [sum(counts), d_bow] float16, as the build's chunk files store them (so a write
    and a build of the same text store the same records); counts [n] int32; images [n]
    the stored page images (espn.pages.images) of a page index, None for text, and grids
    [n, 4] int32 their patch grids (espn.pages.grids).
    """

    ids: list[str]
    lines: list[bytes]
    cls: np.ndarray
    bow: np.ndarray
    counts: np.ndarray
    images: list[bytes] | None = None
    grids: np.ndarray | None = None
    stored: bool = False
    #: stored vectors only: the sha256 of the projection their base stores them through (None: the
    #: model's own vectors; espn.store.projection)
    projection: str | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, rows: Sequence[int]) -> "EncodedDocuments":
        """The documents at `rows`, in that order."""
        picked = np.asarray(rows, dtype=np.int64)
        counts = np.asarray(self.counts, dtype=np.int64)
        starts = np.cumsum(counts) - counts
        lengths = counts[picked]
        gather = np.repeat(starts[picked] - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
        return EncodedDocuments([self.ids[i] for i in picked], [self.lines[i] for i in picked], self.cls[picked],
                                self.bow[gather], self.counts[picked],
                                None if self.images is None else [self.images[i] for i in picked],
                                None if self.grids is None else self.grids[picked], self.stored, self.projection)

    @classmethod
    def concat(cls, parts: Sequence["EncodedDocuments"]) -> "EncodedDocuments":
        # Pages and text never meet in one index; a part without images gives its pages none (b"").
        images = None if all(p.images is None for p in parts) else \
            [image for p in parts for image in (p.images if p.images is not None else [b""] * len(p))]
        grids = None if all(p.grids is None for p in parts) else concat_grids(parts)
        if len({(p.stored, p.projection) for p in parts}) > 1:
            raise ValueError("stored vectors and encoder vectors are written differently: not one segment")
        return cls([i for p in parts for i in p.ids], [line for p in parts for line in p.lines],
                   np.concatenate([p.cls for p in parts]), np.concatenate([p.bow for p in parts]),
                   np.concatenate([p.counts for p in parts]), images, grids, parts[0].stored, parts[0].projection)


def encode_documents(encoder: Encoder, documents: Sequence[tuple[str, str, str, Mapping[str, Any] | None]],
                     batch_size: int = 32, joiner: str = PASSAGE_JOINER) -> EncodedDocuments:
    """Encode (id, title, text, metadata) documents in this thread, in memory: the online write
    path (no corpus or chunk files). Batches are bucketed by length as in the build; a title
    joins its text with `joiner`, the index's (`espn.corpus.index_title_joiner`)."""
    texts = [passage_text(title, text, joiner) for _, title, text, _ in documents]
    _count(len(texts))
    order = encoder.batch_order(texts)
    parts = []
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        embeddings = encoder.embed_documents(encoder.tokenize([texts[i] for i in rows], is_query=False))
        parts.append((np.asarray(rows, dtype=np.int64), embeddings))
    chunk = reorder_chunk(parts)
    lines = [passage_line(title, text, dict(metadata) if metadata else None).encode("utf-8")
             for _, title, text, metadata in documents]
    return EncodedDocuments([doc_id for doc_id, _, _, _ in documents], lines,
                            np.ascontiguousarray(chunk.cls, dtype=np.float16),
                            np.ascontiguousarray(chunk.bow, dtype=np.float16), chunk.counts.astype(np.int32))


def _upload_suffix(data: bytes, where: str) -> str:
    """The suffix (a key of espn.pages.decode.IMAGE_FORMATS) an uploaded page decodes as, from its
    first bytes; CorpusError for anything but PNG, JPEG and WebP, naming what it is where known."""
    if len(data) > MAX_IMAGE_BYTES:
        raise CorpusError(f"{where}: refused, {len(data)} bytes (at most {MAX_IMAGE_BYTES} for an image)")
    suffix = UPLOAD_SUFFIXES.get(media_type(data))
    if suffix is None:
        found = sniff_kind(data[:SIGNATURE_BYTES])
        said = f" (a {found} file)" if found is not None else ""
        raise CorpusError(f"{where}: not a PNG, JPEG or WebP image (by its first bytes){said}")
    return suffix


def page_header(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) of an uploaded page from its header alone, within the bounds a corpus file has
    (espn.pages.decode: MAX_IMAGE_BYTES, the pixel bounds); CorpusError in one line naming `where`."""
    with open_image(io.BytesIO(data), where, _upload_suffix(data, where)) as image:
        return image.size


def decode_page_bytes(data: bytes, where: str) -> Image.Image:
    """An uploaded page (PNG, JPEG or WebP bytes) as RGB, within the bounds a corpus file has
    (espn.pages.decode: MAX_IMAGE_BYTES, and the pixel bounds checked from the header before any pixel
    is decoded); CorpusError in one line naming `where` otherwise. The format is the one its
    first bytes say, and it is decoded only as that."""
    return decode_image(io.BytesIO(data), where, _upload_suffix(data, where))


def _decoded(doc_id: str, data: bytes) -> Image.Image:
    try:
        return decode_page_bytes(bytes(data), f"document {doc_id!r}: image")
    except CorpusError as exc:  # a header that promised more than the pixels hold
        raise InvalidParameterError(str(exc)) from None


def encode_page_documents(encoder: Any, documents: Sequence[tuple[str, bytes, str, str, Mapping[str, Any] | None]],
                          batch_size: int = PAGE_BATCH_SIZE, memory: PageMemory | None = None) -> EncodedDocuments:
    """Encode (id, image bytes, title, text, metadata) pages in this thread: the online write path
    of a page index. Every image's header is checked first (espn.pages.decode's bounds;
    InvalidParameterError naming the document otherwise, TooLargeError for a page that could never fit
    `memory`), then the pages are decoded, preprocessed for the visual encoder and kept as the build
    keeps them (`encode_page_image`) in groups of at most `batch_size` within `memory.group_bytes`,
    each holding its cost from `memory` (the process's page memory by default) while its pixels
    exist; the model then embeds each group. The stored text and metadata follow the build's pages
    (indexing.pages): "page 1 of ID" unless a text is given, and `source` (the id) and `page` (1)
    added where the metadata has no such field."""
    _count(len(documents))
    memory = process_page_memory() if memory is None else memory
    costs = []
    for doc_id, data, _, _, _ in documents:
        where = f"document {doc_id!r}: image"
        try:
            costs.append(page_cost(*page_header(bytes(data), where)))
        except CorpusError as exc:
            raise InvalidParameterError(str(exc)) from None
        memory.check_fits(costs[-1], where)
    parts, stored = [], []
    for group in bounded_groups(costs, batch_size, memory.group_bytes):
        with memory.hold(sum(costs[i] for i in group), f"{len(group)} page(s) of a write"):
            images = [_decoded(documents[i][0], documents[i][1]) for i in group]
            features = encoder.preprocess_pages(images)
            stored += [encode_page_image(image) for image in images]
            del images  # the pixels go before the hold ends; the features are the model's size
        parts.append(encoder.embed_pages(features))
    cls = np.concatenate([p.cls for p in parts])
    bow = np.concatenate([p.bow for p in parts])
    counts = np.concatenate([p.counts for p in parts]).astype(np.int32)
    grids = concat_grids(parts)
    lines = [passage_line(title, text or f"page 1 of {doc_id}",
                          {"source": doc_id, "page": 1, **(dict(metadata) if metadata else {})}).encode("utf-8")
             for doc_id, _, title, text, metadata in documents]
    return EncodedDocuments([doc_id for doc_id, *_ in documents], lines, np.ascontiguousarray(cls, dtype=np.float16),
                            np.ascontiguousarray(bow, dtype=np.float16), counts, stored, grids)


def reorder_chunk(parts: list[tuple[np.ndarray, DocumentEmbeddings]]) -> DocumentEmbeddings:
    """Undo the length bucketing: batches in bucket order -> documents in corpus order."""
    rows = np.concatenate([r for r, _ in parts])
    cls = np.concatenate([e.cls for _, e in parts])
    bow = np.concatenate([e.bow for _, e in parts])
    counts = np.concatenate([e.counts for _, e in parts]).astype(np.int64)
    starts = np.cumsum(counts) - counts
    inverse = np.argsort(rows, kind="stable")
    new_counts = counts[inverse]
    # Row ids of each document's BOW vectors, in corpus order, without a Python loop over documents.
    offsets = np.repeat(starts[inverse] - (np.cumsum(new_counts) - new_counts), new_counts)
    gather = np.arange(int(new_counts.sum())) + offsets
    return DocumentEmbeddings(cls=cls[inverse], bow=bow[gather], counts=new_counts.astype(np.int32))
