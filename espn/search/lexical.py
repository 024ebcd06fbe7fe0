"""The lexical side of a Searcher: the generation's full-text index, searched under the
same restrictions as the vectors, and the explanation of what it matched.

Which directory a Searcher opens: a live-index generation that names its own text
directory (`Generation.text`, written by the live writer) is opened there; otherwise the
base's `text/` (the manifest's `text` section). An index built before full-text indexes
existed has neither: lexical and hybrid searches then raise `TextIndexMissingError`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import InvalidParameterError
from ..results import LexicalMatch
from ..generation.format import LIVE_DIR
from ..generation.segments import LiveView
from ..text.config import TextConfig
from ..text.engine import LexicalHits, TextIndex
from ..text.query import LexicalQuery
from .explain import passage_spans

__all__ = ["TextIndexMissingError", "open_text_index", "search_batch", "lexical_matches"]

log = logging.getLogger(__name__)


class TextIndexMissingError(InvalidParameterError):
    """Lexical or hybrid search on an index without a full-text index."""


def open_text_index(base_path: Path, manifest: Mapping[str, Any], view: LiveView | None = None) -> TextIndex | None:
    """The text index of the generation a Searcher serves, or None when the index has none."""
    section = manifest.get("text")
    if section is None:
        return None
    if "text/meta.json" not in manifest.get("files", {}):
        # A base compacted by a live writer that does not build text indexes yet carries the
        # section but not the files: dense only until `espn text-index` adds one again.
        log.warning("%s: the manifest describes a full-text index but lists none of its files; lexical and "
                    "hybrid search are off (`espn text-index` rebuilds it)", base_path)
        return None

    directory = Path(base_path) / section.get("directory", "text")
    generation_text = view.generation.side.get("text") if view is not None else None
    if generation_text and generation_text.get("directory"):  # kept live: this generation's own
        directory = view.root / LIVE_DIR / generation_text["directory"]  # type: ignore[union-attr]
    elif view is not None and view.generation.segments:
        log.warning("%s: generation %d has delta segments but no text index of its own: the lexical side "
                    "searches the base's documents only", view.root, view.generation.number)
    return TextIndex(directory, TextConfig.from_json(section.get("analyzer", {})))


def require_text(text: TextIndex | None, mode: str) -> TextIndex:
    if text is None:
        raise TextIndexMissingError(
            f"mode {mode!r} needs a full-text index and this index has none (it was built before they existed); "
            "add one with `espn text-index INDEX`, or search with mode 'dense'")
    return text


def search_batch(text: TextIndex, queries: Sequence[LexicalQuery], limit: int,
                 allowed: np.ndarray | None) -> list[LexicalHits]:
    """Each query's top `limit` by BM25 among the `allowed` documents."""
    return [text.search(query, limit, allowed) for query in queries]


def lexical_matches(text: TextIndex, query: LexicalQuery, doc_number: int, title: str,
                    body: str) -> tuple[LexicalMatch, ...]:
    """What the lexical side matched in one document: each matching clause, its BM25
    contribution and where its words occur in the passage."""
    out = []
    for clause, score in text.term_scores(query, doc_number):
        spans = text.highlights(LexicalQuery(query.source, tuple(c for c in query.clauses
                                                                 if c.start == clause.query_start)), title, body)
        out.append(LexicalMatch(terms=clause.terms, query_start=clause.query_start, query_end=clause.query_end,
                                score=score, spans=passage_spans(title, body, spans)))
    return tuple(out)
