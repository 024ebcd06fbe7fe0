"""`espn add`'s bulk path: a corpus file encoded the way the build encodes one (a DataLoader of
tokenising workers, chunk files), then published through the live writer as one generation.

The online writer (espn.live) encodes in memory and never loads the DataLoader; this module
is the build job reusing it, never the reverse.
"""

from __future__ import annotations

from pathlib import Path

from espn.corpus import index_title_joiner
from espn.errors import CorpusError
from espn.index import read_manifest
from espn.files import checkpoint
from espn.live.checks import WriteRequest, WriteResult
from espn.live.writer import IndexWriter
from espn.live.encoding import EncodedDocuments
from espn.live.staging import Staging
from espn.metadata import check_field_count

from .chunks import Chunk, finished_chunks, read_chunk
from .encode import encode_corpus
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
               progress: bool = False, skip_bad: bool = False, wait_s: float = 0.0) -> WriteResult:
    """Upsert every document of a corpus file (BEIR jsonl or TSV) as one generation.

    Encoding runs without the writer lock (into chunk files of a staging directory, as
    the build does), so writers of a running server are not held up; the lock is taken
    (waiting up to `wait_s`) only to publish.
    """
    corpus = Path(corpus)
    if not corpus.is_file():
        raise CorpusError(f"{corpus}: no such file")
    scan = scan_corpus(corpus, skip_bad)  # ids valid and unique, lines valid, before any encoding
    if scan.documents == 0:
        raise CorpusError(f"{corpus}: the corpus has no documents")
    with Staging(writer, "add", wait_s) as work:
        encode_corpus(corpus, work.path, writer.encoder(), batch_size=batch_size, loader_workers=loader_workers,
                      progress=progress, skip_bad=skip_bad, total_documents=scan.documents,
                      joiner=index_title_joiner(read_manifest(writer.root)))
        checkpoint("encoded")
        documents = EncodedDocuments.concat([encoded_chunk(read_chunk(work.path, c))
                                             for c in finished_chunks(work.path)])
        writer.partition.check_owned(documents.ids)
        try:
            check_field_count(scan.metadata_fields, writer.limits.metadata)
        except ValueError as exc:
            raise CorpusError(f"{corpus}: {exc}") from None
        outcome = writer.publish([WriteRequest(tuple(documents.ids), (), scan.metadata_fields)], [documents],
                                 wait_s)[0]
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
