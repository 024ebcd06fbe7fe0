"""What a router needs of a partitioned index: which partition owns an id, the layout a
partition reports, and the fusion of the partitions' hybrid pools as one index fuses its own."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..params import DEFAULT_RERANK_COUNT, HybridParams
from ..partitioning import HASH_NAME, PartitionLayout, owner
from ..search.hybrid import Fused, fuse

__all__ = ["Partitions", "PARTITIONS"]


class Partitions:
    """Partitioning and fusion, as the router calls them."""

    hash_name = HASH_NAME

    @staticmethod
    def owner(doc_id: str, count: int) -> int:
        """The partition of `count` that owns `doc_id` (the rule the build placed documents by)."""
        return owner(doc_id, count)

    @staticmethod
    def layout(index: int, count: int, by: str | None = HASH_NAME) -> PartitionLayout:
        return PartitionLayout(index, count, by)

    @staticmethod
    def hybrid_params(section: Mapping[str, Any]) -> HybridParams:
        """Fusion parameters as a partition reports them (`stats.hybrid`); InvalidParameterError if they are not."""
        return HybridParams.from_manifest(section)

    @staticmethod
    def rerank_count(section: Mapping[str, Any]) -> int:
        return int(section.get("rerank_count", DEFAULT_RERANK_COUNT))

    @staticmethod
    def fuse(pool: np.ndarray, dense: np.ndarray, lexical: np.ndarray, params: HybridParams) -> Fused:
        """The fused ranking of a pool (espn.search.hybrid.fuse)."""
        return fuse(pool, dense, lexical, params)


#: The router's view of partitioning and fusion.
PARTITIONS = Partitions()
