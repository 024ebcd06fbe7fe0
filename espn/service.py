"""The library as the server sees it: the only door between `espn_server` and `espn`.

Every module of the server (espn_server, the router included) imports from the library this
module and `espn.errors`, nothing else (tests/test_code_layout.py holds them to it). What it
lists is what the server needs and no more: searching with per-query isolation (a query the
library refuses costs only itself), explaining, documents and their sizes, writes and
compaction, status and readiness, snapshots, replication, and the limits and parameter types
the HTTP schemas validate against. Work the server would otherwise do on the library's files
(reading an index file by name, re-timing the search stages, knowing which searcher can
explain) is behind these names, where the library can change it without the server knowing.

Importing it is light: the names below `_LAZY` load their modules (torch, FAISS, numpy) at
their first use, so that `espn --help`, which reads the server's settings, loads none of them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .choices import DEFAULT_LEASE_S, MAX_LEASE_S, MIN_LEASE_S, READER_NAMES
from .files import is_index_directory, resident_bytes
from .ids import MAX_ID_BYTES, decode_doc_id, id_problem
from .params import (DEFAULT_RERANK_COUNT, MAX_CANDIDATES, MAX_K, MAX_PREFETCH_K, MAX_PROBE, MAX_RERANK,
                     NO_TEXT_PATTERN, SearchParams, has_text)
from .results import Document, QueryResult
from .search.isolation import Outcomes, SearchGroup, encode_together, search_each, search_isolated, sort_outcomes

if TYPE_CHECKING:  # what `_LAZY` loads at first use, for the type checker
    from .cli import CliParser, build_parser
    from .encoders import Encoder, load_encoder
    from .files import lock_is_free
    from .filters import MAX_FILTER_BRANCHES, MAX_FILTER_NODES, MAX_FILTER_VALUES, canonical_filter
    from .generation.live_searcher import LiveSearcher
    from .index import encoder_label
    from .generation.segments import open_view
    from .live.checks import NewDocument, WriteLimits, WriteResult
    from .live.commit import GroupCommit, lower_priority
    from .live.compaction import CompactionPolicy, CompactionRunningError
    from .live.live_index import LiveIndex
    from .live.replication.fenced import FencedWriter
    from .live.replication.cluster import Cluster, read_cluster
    from .live.replication.follower import Follower
    from .live.replication.store import make_client as make_store_client
    from .live.replication.publisher import Publisher
    from .live.replication.restore import restore_from_store
    from .live.create import create_empty_index, live_documents, remove_index
    from .live.create import remove_leftovers as remove_index_leftovers
    from .live.snapshot import default_name, snapshot, snapshots_in
    from .live.snapshot import remove_leftovers as remove_snapshot_leftovers
    from .live.status import read_only_reason
    from .metadata import MetadataLimits
    from .pages.images import (BASE64_PATTERN, MAX_BASE64_CHARS, MAX_THUMBNAIL_SIDE, MIN_THUMBNAIL_SIDE,
                               decode_base64_image)
    from .partitioning import HASH_NAME, PartitionLayout, WrongPartitionError, owner
    from .prefetch import PrefetchEstimates
    from .search.hybrid import MAX_LEXICAL_K, HybridParams, fuse
    from .search.searcher import Searcher
    from .search.validation import MAX_QUERY_CHARS
    from .untrusted import MAX_JSON_DEPTH, check_json_depth, load_json

__all__ = [
    # searching: open an index, search with per-query isolation, explain (Searcher.check_request), documents
    "Searcher", "LiveSearcher", "Encoder", "load_encoder", "open_view",
    "search_each", "search_isolated", "encode_together", "sort_outcomes", "Outcomes", "SearchGroup",
    "canonical_filter", "QueryResult", "Document", "PrefetchEstimates",
    # parameter types, and the router's fusion of its shards' answers
    "SearchParams", "HybridParams", "fuse",
    # limits and formats the HTTP schemas validate against
    "MAX_K", "MAX_RERANK", "MAX_PREFETCH_K", "MAX_PROBE", "MAX_CANDIDATES", "DEFAULT_RERANK_COUNT",
    "MAX_QUERY_CHARS", "MAX_LEXICAL_K", "NO_TEXT_PATTERN", "has_text",
    "MAX_ID_BYTES", "decode_doc_id", "id_problem",
    "MAX_FILTER_BRANCHES", "MAX_FILTER_NODES", "MAX_FILTER_VALUES",
    "BASE64_PATTERN", "MAX_BASE64_CHARS", "decode_base64_image", "MIN_THUMBNAIL_SIDE", "MAX_THUMBNAIL_SIDE",
    "MAX_JSON_DEPTH", "check_json_depth", "load_json", "READER_NAMES",
    # writes and compaction
    "LiveIndex", "GroupCommit", "lower_priority", "NewDocument", "WriteLimits", "WriteResult", "MetadataLimits",
    "CompactionPolicy", "CompactionRunningError",
    # status and readiness
    "read_only_reason", "lock_is_free",
    # index administration (an empty index made and removed in an index root)
    "create_empty_index", "remove_index", "remove_index_leftovers", "live_documents", "is_index_directory",
    "resident_bytes", "encoder_label",
    # snapshots
    "snapshot", "default_name", "snapshots_in", "remove_snapshot_leftovers",
    # replication and partitions
    "Follower", "Publisher", "FencedWriter", "restore_from_store", "PartitionLayout", "WrongPartitionError",
    "HASH_NAME", "owner", "DEFAULT_LEASE_S", "MIN_LEASE_S", "MAX_LEASE_S", "Cluster", "read_cluster",
    "make_store_client",
    # the command line the server joins (`python -m espn_server`, the generated reference pages)
    "CliParser", "build_parser",
]

#: Name -> the library module that defines it ("module:name" where the library's name differs),
#: loaded at the name's first use (see the docstring).
_LAZY: dict[str, str] = {
    **dict.fromkeys(("CliParser", "build_parser"), "espn.cli"),
    **dict.fromkeys(("Encoder", "load_encoder"), "espn.encoders"),
    "lock_is_free": "espn.files",
    **dict.fromkeys(("MAX_FILTER_BRANCHES", "MAX_FILTER_NODES", "MAX_FILTER_VALUES", "canonical_filter"),
                    "espn.filters"),
    "LiveSearcher": "espn.generation.live_searcher",
    "encoder_label": "espn.index",
    "open_view": "espn.generation.segments",
    **dict.fromkeys(("NewDocument", "WriteLimits", "WriteResult"), "espn.live.checks"),
    **dict.fromkeys(("GroupCommit", "lower_priority"), "espn.live.commit"),
    **dict.fromkeys(("CompactionPolicy", "CompactionRunningError"), "espn.live.compaction"),
    "LiveIndex": "espn.live.live_index",
    "Follower": "espn.live.replication.follower",
    "FencedWriter": "espn.live.replication.fenced",
    **dict.fromkeys(("Cluster", "read_cluster"), "espn.live.replication.cluster"),
    "make_store_client": "espn.live.replication.store:make_client",
    "Publisher": "espn.live.replication.publisher",
    "restore_from_store": "espn.live.replication.restore",
    **dict.fromkeys(("create_empty_index", "live_documents", "remove_index"), "espn.live.create"),
    "remove_index_leftovers": "espn.live.create:remove_leftovers",
    **dict.fromkeys(("default_name", "snapshot", "snapshots_in"), "espn.live.snapshot"),
    "remove_snapshot_leftovers": "espn.live.snapshot:remove_leftovers",
    "read_only_reason": "espn.live.status",
    "MetadataLimits": "espn.metadata",
    **dict.fromkeys(("BASE64_PATTERN", "MAX_BASE64_CHARS", "MAX_THUMBNAIL_SIDE", "MIN_THUMBNAIL_SIDE",
                     "decode_base64_image"), "espn.pages.images"),
    **dict.fromkeys(("HASH_NAME", "PartitionLayout", "WrongPartitionError", "owner"), "espn.partitioning"),
    "PrefetchEstimates": "espn.prefetch",
    **dict.fromkeys(("MAX_LEXICAL_K", "HybridParams", "fuse"), "espn.search.hybrid"),
    "Searcher": "espn.search.searcher",
    "MAX_QUERY_CHARS": "espn.search.validation",
    **dict.fromkeys(("MAX_JSON_DEPTH", "check_json_depth", "load_json"), "espn.untrusted"),
}


def __getattr__(name: str) -> Any:
    """A name of `_LAZY`, its module imported now (once: the value is kept in this module)."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attribute = where.partition(":")
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value
    return value
