"""`espn add`'s bulk path: a corpus file encoded the way the build encodes one (a DataLoader of
tokenising workers, chunk files), then published through the live writer as one generation.

The online writer (espn.live) encodes in memory and never loads the DataLoader; this module
is the build job reusing it, never the reverse.
"""

from __future__ import annotations

import json
from pathlib import Path

from espn.encoders.base import reads_pages
from espn.corpus import index_title_joiner
from espn.errors import CorpusError
from espn.index import read_manifest
from espn.files.crash_points import checkpoint
from espn.live.checks import WriteRequest, WriteResult
from espn.live.writer import IndexWriter
from espn.live.encoding import EncodedDocuments
from espn.live.staging import Staging
from espn.metadata import check_field_count, merge_types, value_type
from espn.pages.corpus import DEFAULT_DPI, count_pages, is_page_corpus, no_pages_error

from .chunks import Chunk, finished_chunks, read_chunk
from .encode import encode_corpus
from .pages import PageEncoder, encode_page_corpus
from .scan import scan_corpus

__all__ = ["add_corpus", "encoded_chunk"]


def encoded_chunk(chunk: Chunk) -> EncodedDocuments:
    """A chunk file's documents as the writer takes them."""
    blob, offsets = chunk.docs_blob.tobytes(), chunk.docs_offsets
    lines = [blob[offsets[i] : offsets[i + 1]] for i in range(len(chunk))]
    images = None
    if chunk.images_blob is not None and chunk.images_offsets is not None:  # a page chunk (indexing.pages)
        raw, at = chunk.images_blob.tobytes(), chunk.images_offsets.tolist()
        images = [raw[at[i] : at[i + 1]] for i in range(len(chunk))]
    return EncodedDocuments([bytes(i).decode("utf-8") for i in chunk.ids], lines, chunk.cls, chunk.bow, chunk.counts,
                            images)


def add_corpus(writer: IndexWriter, corpus: Path, *, batch_size: int = 32, loader_workers: int = 1,
               progress: bool = False, skip_bad: bool = False, wait_s: float = 0.0,
               dpi: int = DEFAULT_DPI) -> WriteResult:
    """Upsert every document of a corpus (BEIR jsonl or TSV; for an index of pages, a page corpus:
    a folder of images or PDFs, a PDF, or a JSONL of images, rendered at `dpi`) as one generation.

    Encoding runs without the writer lock (into chunk files of a staging directory, as
    the build does), so writers of a running server are not held up; the lock is taken
    (waiting up to `wait_s`) only to publish.
    """
    corpus = Path(corpus)
    pages = reads_pages(read_manifest(writer.root)["encoder"])
    if pages != is_page_corpus(corpus) and corpus.exists():
        raise CorpusError(f"{corpus}: the index holds {'pages' if pages else 'text'}; give a "
                          f"{'folder of images or PDFs, a PDF, or a JSONL of images' if pages else 'text corpus'}")
    if not (corpus.is_file() or (pages and corpus.is_dir())):
        raise CorpusError(f"{corpus}: no such file")
    with Staging(writer, "add", wait_s) as work:
        if pages:
            documents, fields = _encoded_pages(writer, corpus, work.path, batch_size, loader_workers, progress,
                                               skip_bad, dpi)
        else:
            documents, fields = _encoded_text(writer, corpus, work.path, batch_size, loader_workers, progress,
                                              skip_bad)
        writer.partition.check_owned(documents.ids)
        try:
            check_field_count(fields, writer.limits.metadata)
        except ValueError as exc:
            raise CorpusError(f"{corpus}: {exc}") from None
        outcome = writer.publish([WriteRequest(tuple(documents.ids), (), fields)], [documents], wait_s)[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def _encoded_text(writer: IndexWriter, corpus: Path, work: Path, batch_size: int, loader_workers: int,
                  progress: bool, skip_bad: bool) -> tuple[EncodedDocuments, dict[str, str]]:
    scan = scan_corpus(corpus, skip_bad)  # ids valid and unique, lines valid, before any encoding
    if scan.documents == 0:
        raise CorpusError(f"{corpus}: the corpus has no documents")
    encode_corpus(corpus, work, writer.encoder(), batch_size=batch_size, loader_workers=loader_workers,
                  progress=progress, skip_bad=skip_bad, total_documents=scan.documents,
                  joiner=index_title_joiner(read_manifest(writer.root)))
    checkpoint("encoded")
    return _staged(work), scan.metadata_fields


def _encoded_pages(writer: IndexWriter, corpus: Path, work: Path, batch_size: int, loader_workers: int,
                   progress: bool, skip_bad: bool, dpi: int) -> tuple[EncodedDocuments, dict[str, str]]:
    """The pages encoded as the build encodes them (ids are checked unique while they are read)."""
    pages = count_pages(corpus)
    if pages == 0:  # the refusal of its first file, before the model runs
        raise no_pages_error(corpus)
    encoder: PageEncoder = writer.encoder()  # type: ignore[assignment]  # a page index's encoder reads pages
    totals = encode_page_corpus(corpus, work, encoder, dpi=dpi, batch_size=batch_size, skip_bad=skip_bad,
                                loader_workers=loader_workers, progress=progress, total_pages=pages)
    if totals["documents"] == 0:
        raise CorpusError(f"{corpus}: the corpus has no readable pages")
    checkpoint("encoded")
    documents = _staged(work)
    fields: dict[str, str] = {}  # one entry per field; the lines are the chunk files' own (bounded by the build)
    for line in documents.lines:
        for name, value in (json.loads(line).get("metadata") or {}).items():
            try:
                fields[name] = merge_types(fields.get(name), value_type(value)) or fields.get(name, "")
            except ValueError as exc:
                raise CorpusError(f"{corpus}: metadata field {name!r} {exc}") from None
    return documents, {name: kind for name, kind in fields.items() if kind}


def _staged(work: Path) -> EncodedDocuments:
    return EncodedDocuments.concat([encoded_chunk(read_chunk(work, c)) for c in finished_chunks(work)])
