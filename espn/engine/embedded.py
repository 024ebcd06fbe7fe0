"""An index in a Python process, with no server: `espn.Index`.

    with Index.create("my-index") as index:            # empty, in a fraction of a second
        index.add([{"id": "d1", "text": "The Moon pulls the oceans."}])
        hits = index.search(["what causes tides"], k=3)[0].hits

The same parts as a server's engine (espn.engine.writing and a live searcher): writes are
published as generations (durable when `add` returns, seen by the next search), compaction
runs in a background thread past the policy's thresholds and fits the index on its own
documents as it grows (espn.live.fitting), `refit` asks for that at once. One process writes
an index at a time (its writer lock); any number may search it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from ..encoders import encoder_from_spec
from ..live.checks import NewDocument, WriteResult
from ..live.create import NewIndex, create_index
from ..live.live_index import LiveIndex
from ..live.status import live_stats
from ..results import Document, QueryResult
from ..search.live_searcher import LiveSearcher
from ..search.searcher import Searcher
from ..text.config import TextConfig
from .config import IndexConfig
from .writing import Writing

__all__ = ["Index"]

Written = NewDocument | Mapping[str, Any]


def _document(item: Written) -> NewDocument:
    if isinstance(item, NewDocument):
        return item
    known = {"id", "text", "title", "metadata", "image"}
    if "id" not in item or set(item) - known:
        raise TypeError(f"a document is a NewDocument or a mapping with 'id' and any of text, title, metadata, "
                        f"image; got the keys {sorted(item)}")
    return NewDocument(str(item["id"]), item.get("text", ""), item.get("title", ""), item.get("metadata"),
                       item.get("image"))


class Index:
    """A live index opened in this process for searches and writes (see the module doc)."""

    def __init__(self, path: Path, config: IndexConfig) -> None:
        self.path = Path(path)
        self.config = config
        # The RAM plan and the record cache as a server's (IndexConfig.ram_mib, record_cache_mb).
        self._live = LiveSearcher(Searcher.open(self.path, reader=config.reader, device=config.device,
                                                reader_options=config.open_options(),
                                                trust_remote_code=config.trust_remote_code))
        self._writing: Optional[Writing] = None

    @classmethod
    def create(cls, path: Path | str, encoder: str = "minilm", *, dtype: str = NewIndex.dtype,
               first_stage: Optional[str] = None, text_index: bool = True, device: Optional[str] = None,
               trust_remote_code: bool = False, bow_dim: Optional[int] = None,
               config: IndexConfig = IndexConfig()) -> "Index":
        """An empty index at `path` (which must not exist) with `encoder` (a spec as `espn index
        --encoder` takes it), opened. It is searched exactly while small and fitted on its own
        documents as it grows; nothing is trained on other text. bow_dim: the projection of its
        token vectors fitted then (`espn create --bow-dim`; None: the model's default)."""
        model = encoder_from_spec(encoder, bow_dim=None, device=device, trust_remote_code=trust_remote_code)
        create_index(path, model, NewIndex(dtype=dtype, first_stage=first_stage, bow_dim=bow_dim,
                                           text_index=TextConfig() if text_index else None))
        return cls.open(path, config=config.replace(device=device, trust_remote_code=trust_remote_code))

    @classmethod
    def open(cls, path: Path | str, config: IndexConfig = IndexConfig()) -> "Index":
        """An existing index (built by `espn index`, or created)."""
        return cls(Path(path), config)

    def add(self, documents: Iterable[Written]) -> WriteResult:
        """Add documents, or replace those whose id exists; durable and searchable when it returns."""
        return self._write([_document(item) for item in documents], [])

    def delete(self, doc_ids: Sequence[str]) -> WriteResult:
        return self._write([], list(doc_ids))

    def search(self, queries: Sequence[str], k: int = 10, **params: Any) -> list[QueryResult]:
        """Each query's hits, best first (params: as espn.Searcher.search takes them)."""
        self._live.refresh()
        with self._live.lease() as searcher:
            return searcher.search(list(queries), k=k, **params)

    def document(self, doc_id: str) -> Document:
        self._live.refresh()
        with self._live.lease() as searcher:
            return searcher.document(doc_id)

    def refit(self) -> WriteResult:
        """Fit the index's IVF, token centroids and residual codes on its live documents now (a base
        rewrite from a snapshot; writes from other threads go on meanwhile)."""
        with LiveIndex(self.path) as writer:
            result = writer.refit(wait_s=self.config.write_wait_s)
        self._live.refresh()
        return result

    def stats(self) -> dict[str, Any]:
        """Counts, what the index is fitted on and whether a re-fit runs (espn.live.status.live_stats),
        and its reader: which one, its RAM plan and record cache (`reader`)."""
        with self._live.lease() as searcher:
            reader = searcher.reader.describe()
        return {**live_stats(self.path), "reader": reader}

    def close(self) -> None:
        """Let a running compaction finish, publish what was accepted, close the searcher."""
        if self._writing is not None:
            self._writing.close()
            self._writing = None
        self._live.close()

    def __enter__(self) -> "Index":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self, generation: int) -> None:
        """On the publishing thread: searches see a write before `add` returns."""
        self._live.refresh()

    def _write(self, upserts: list[NewDocument], deletes: list[str]) -> WriteResult:
        if self._writing is None:
            self._writing = Writing(self.path, self.config, self._serve)
        result = self._writing.submit(upserts, deletes).result()
        self._writing.maybe_compact()
        return result
