"""What a search call must hold before any work starts: its query texts, its embeddings, its flags.

Each check raises InvalidParameterError naming the parameter; per-request numbers
(`k`, `nprobe`, ...) are checked by `espn.params.SearchParams.validate`, modes and fusion by
`espn.params.HybridParams`.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..encoders import QueryEmbeddings
from ..errors import InvalidParameterError
from ..params import MAX_QUERY_CHARS, has_text
from ..store.format import StoreLayout

__all__ = ["MAX_QUERY_CHARS", "MAX_BATCH", "check_texts", "check_explain", "check_embeddings"]

MAX_BATCH = 1024


def check_texts(queries: Sequence[str]) -> None:
    """A list of at most MAX_BATCH strings, each with text to search and at most MAX_QUERY_CHARS."""
    if isinstance(queries, str) or not isinstance(queries, Sequence):
        raise InvalidParameterError("queries must be a list of strings")
    if len(queries) > MAX_BATCH:
        raise InvalidParameterError(f"a batch holds at most {MAX_BATCH} queries, got {len(queries)}")
    for i, query in enumerate(queries):
        which = f"query {i}" if len(queries) > 1 else "the query"
        if not isinstance(query, str) or not has_text(query):
            raise InvalidParameterError(f"{which} must be a non-empty string (it has no text: only "
                                        "whitespace or control characters)")
        if len(query) > MAX_QUERY_CHARS:
            raise InvalidParameterError(f"{which} has {len(query)} characters; at most {MAX_QUERY_CHARS}")


def check_explain(explain: Any) -> None:
    if not isinstance(explain, bool):
        raise InvalidParameterError(f"explain must be true or false, got {explain!r}")


def check_embeddings(queries: QueryEmbeddings, layout: StoreLayout) -> None:
    """Query embeddings of the index's dimensions: cls [B, d_cls], bow [B, L, d_bow]."""
    if queries.cls.ndim != 2 or queries.cls.shape[1] != layout.d_cls or queries.bow.shape[-1] != layout.d_bow:
        raise InvalidParameterError(
            f"query embeddings must have d_cls={layout.d_cls}, d_bow={layout.d_bow}; "
            f"got cls {queries.cls.shape}, bow {queries.bow.shape}")
