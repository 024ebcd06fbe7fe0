"""What a router needs of a partitioned index: which partition owns an id, the layout a
partition reports, the fusion of the partitions' hybrid pools as one index fuses its own, and
a shard map on object storage as routing reads it (`ShardMapView`)."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..live.replication.cluster import Cluster, read_cluster
from ..live.replication.store import make_client
from ..params import DEFAULT_RERANK_COUNT, HybridParams
from ..partitioning import HASH_NAME, PartitionLayout, owner
from ..search.hybrid import Fused, fuse

__all__ = ["Partitions", "PARTITIONS", "ShardMapView"]


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


class ShardMapView:
    """A shard map on object storage (espn.shard_map, written by `espn shard-map init` and moved by
    `espn reshard`) as a router routes by it: the partitions that own slots, each one's replicas
    (the servers that registered, followers first) and its writer (the holder of its lease), and
    which partition owns an id. Immutable: `read` gives the next view, so that a router swaps
    the whole of it at once."""

    def __init__(self, cluster: Cluster, client: Any) -> None:
        self.cluster, self.client = cluster, client  # the store's answer, and the client that read it

    @classmethod
    def read(cls, url: str, previous: Optional["ShardMapView"] = None) -> "ShardMapView":
        """The view at `url` (s3://BUCKET/PREFIX): the map re-read only when its ETag moved since
        `previous`, the leases and members every time. Blocking (object storage): call it in a
        thread. InvalidParameterError when there is no map; ObjectStoreError when the store fails."""
        client = previous.client if previous is not None else make_client()
        return cls(read_cluster(client, url, previous.cluster if previous is not None else None), client)

    @property
    def version(self) -> int:
        return self.cluster.shard_map.version

    def partitions(self) -> list[int]:
        """The partitions searches go to: those that own slots, or take part in a move."""
        return self.cluster.shard_map.searched()

    def replicas(self, partition: int) -> list[str]:
        return self.cluster.replicas(partition)

    def writer(self, partition: int) -> Optional[str]:
        """The URL of the partition's writer (its lease's holder); None while none holds it."""
        return self.cluster.writer_url(partition)

    def owner(self, doc_id: str) -> int:
        return self.cluster.shard_map.owner(doc_id)

    def owned(self, partition: int, ids: Sequence[str]) -> np.ndarray:
        """[n] bool: which of these ids the map gives to `partition` (during a move an id can be
        in two partitions for a moment; only its owner's copy counts)."""
        if not ids:
            return np.zeros(0, dtype=bool)
        owners = self.cluster.shard_map.owners_of(np.array([i.encode("utf-8") for i in ids], dtype=bytes))
        return np.asarray(owners == partition)
