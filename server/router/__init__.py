"""The router: one endpoint in front of an index split into partitions (see `app`)."""

from ..settings import RouterSettings
from .app import RoutedBatchResponse, RoutedSearchResponse, ShardFailure, build_router_app, fuse_hits, merge_hits, run_route

__all__ = [
    "RouterSettings",
    "ShardFailure",
    "RoutedSearchResponse",
    "RoutedBatchResponse",
    "merge_hits",
    "fuse_hits",
    "build_router_app",
    "run_route",
]
