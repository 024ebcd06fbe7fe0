"""The full-text side of hybrid retrieval: analyzer config, query syntax, the engine.

`build_text_index` writes a generation-0 text index (the build job); `TextIndex` opens one
generation read-only and searches it by BM25, restricted to an allowed bitmap;
`TextWriter` applies adds and deletes and publishes each generation as its own directory
(the live-index writer calls it). `parse_query` reads the lexical query syntax.
"""

from __future__ import annotations

from .config import STEMMER_LANGUAGES, STOP_WORD_LANGUAGES, TextConfig
from .engine import LexicalHits, TextIndex, build_text_index
from .query import Clause, LexicalQuery, QuerySyntaxError, parse_query
from .schema import TextDocument
from .writer import TextWriter

__all__ = [
    "TextConfig",
    "STEMMER_LANGUAGES",
    "STOP_WORD_LANGUAGES",
    "Clause",
    "LexicalQuery",
    "QuerySyntaxError",
    "parse_query",
    "TextDocument",
    "LexicalHits",
    "TextIndex",
    "TextWriter",
    "build_text_index",
]

