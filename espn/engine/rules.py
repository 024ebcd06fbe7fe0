"""What the library accepts from outside, in one place: the limits, patterns and checks that an
HTTP schema, a client or a help text states and that the library enforces.

Each value here is the library's own constant (defined beside the code that enforces it),
gathered so that an entry point reads them through its one door (`espn.engine`) and states
exactly what the library will refuse. Loads no torch or FAISS.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from ..choices import MAX_LEASE_S, MIN_LEASE_S, READER_NAMES
from ..errors import RefusedInputError
from ..files.index_directory import is_index_directory
from ..filters import MAX_FILTER_BRANCHES, MAX_FILTER_NODES, MAX_FILTER_VALUES
from ..ids import MAX_ID_BYTES, decode_doc_id, id_problem
from ..pages.images import BASE64_PATTERN, MAX_BASE64_CHARS, MAX_THUMBNAIL_SIDE, MIN_THUMBNAIL_SIDE, decode_base64_image
from ..params import (DEFAULT_RERANK_COUNT, MAX_CANDIDATES, MAX_K, MAX_LEXICAL_K, MAX_PREFETCH_K, MAX_PROBE,
                      MAX_QUERY_CHARS, MAX_RERANK, NO_TEXT_PATTERN, has_text)
from ..untrusted import MAX_JSON_DEPTH, check_json_depth, load_json, read_json_file

__all__ = ["InputRules", "RULES", "INDEX_NAME_PATTERN", "INDEX_NAME_RULE"]

#: What an index's name may be: a URL path segment and a directory name (matched whole:
#: `fullmatch`, so a trailing newline is no name).
INDEX_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
#: INDEX_NAME_PATTERN in words, for the messages that refuse a name.
INDEX_NAME_RULE = "letters, digits, '_', '.', '-' (at most 64, not first '.', '_' or '-')"
_INDEX_NAME = re.compile(INDEX_NAME_PATTERN)


class InputRules:
    """The library's limits (attributes) and checks (methods) of what arrives from outside."""

    # searches
    max_k = MAX_K
    max_rerank = MAX_RERANK
    max_prefetch_k = MAX_PREFETCH_K
    max_probe = MAX_PROBE
    max_candidates = MAX_CANDIDATES
    max_lexical_k = MAX_LEXICAL_K
    default_rerank_count = DEFAULT_RERANK_COUNT
    max_query_chars = MAX_QUERY_CHARS
    no_text_pattern = NO_TEXT_PATTERN
    # filters
    max_filter_nodes = MAX_FILTER_NODES
    max_filter_values = MAX_FILTER_VALUES
    max_filter_branches = MAX_FILTER_BRANCHES
    # documents and pages
    max_id_bytes = MAX_ID_BYTES
    base64_pattern = BASE64_PATTERN
    max_base64_chars = MAX_BASE64_CHARS
    min_thumbnail_side = MIN_THUMBNAIL_SIDE
    max_thumbnail_side = MAX_THUMBNAIL_SIDE
    # JSON from outside (request bodies, a partition's answer)
    max_json_depth = MAX_JSON_DEPTH
    # indexes
    index_name_pattern = INDEX_NAME_PATTERN
    index_name_rule = INDEX_NAME_RULE
    reader_names = READER_NAMES
    # replication: the bounds of a fenced writer's lease (espn.live.replication.lease)
    min_lease_s = MIN_LEASE_S
    max_lease_s = MAX_LEASE_S

    @staticmethod
    def has_text(query: str) -> bool:
        """Whether a query holds something to search (not only whitespace or control characters)."""
        return has_text(query)

    @staticmethod
    def id_problem(doc_id: str) -> Optional[str]:
        """What is wrong with a document id, in words (None: nothing)."""
        return id_problem(doc_id)

    @staticmethod
    def decode_doc_id(raw: bytes) -> str:
        """An id sent as bytes (a URL path), as strict UTF-8 under the id rules (InvalidParameterError)."""
        return decode_doc_id(raw)

    @staticmethod
    def decode_base64_image(text: object) -> bytes:
        """A page's bytes sent as base64 text (ValueError naming `image` for anything else)."""
        return decode_base64_image(text)

    @staticmethod
    def check_json_depth(data: bytes | str, what: str, max_depth: int = MAX_JSON_DEPTH) -> None:
        """Refuse JSON nested deeper than `max_depth` before it is parsed (RefusedInputError)."""
        check_json_depth(data, what, max_depth)

    @staticmethod
    def load_json(data: bytes | str, what: str, *, max_bytes: int, finite: bool = False,
                  error: type[Exception] = RefusedInputError) -> Any:
        """JSON from outside, bounded in size and depth before it is parsed; any failure is `error`.
        finite: every number parsed is a finite float (no NaN, Infinity, or past a float's range)."""
        return load_json(data, what, max_bytes=max_bytes, finite=finite, error=error)

    @staticmethod
    def read_json_file(path: Path, what: str, *, max_bytes: int, follow_links: bool = False,
                       error: type[Exception] = RefusedInputError) -> Any:
        """A JSON file read as input from outside: a regular file (never a FIFO or a device, opened
        without blocking), bounded in size and depth before it is parsed; any failure is `error`."""
        return read_json_file(path, what, max_bytes=max_bytes, follow_links=follow_links, error=error)

    @staticmethod
    def index_name_problem(name: str) -> Optional[str]:
        """Why `name` cannot name an index (None: it can)."""
        return None if _INDEX_NAME.fullmatch(name) else f"index name {name!r}: {INDEX_NAME_RULE}"

    @staticmethod
    def is_index_directory(path: Path | str) -> bool:
        """Whether `path` holds an index (a manifest)."""
        return is_index_directory(path)


#: The rules, as the entry points read them.
RULES = InputRules()
