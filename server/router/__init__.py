"""The router: one endpoint in front of an index split into partitions.

`espn index CORPUS --out DIR --partitions S` writes S complete indexes that share one
encoder and one projection, so a score from one partition compares with a score from
another. Each partition is served by `espn serve` (replicas behind one address each: a
Kubernetes Service, a load balancer). The router fans every query out to all of them at
once, waits at most `timeout_ms` for each, and merges their top-k by score. A partition
that errors, does not answer in time, or answers what does not check as a search answer (the
server's schema, finite scores, at most k hits, read within a byte limit: `answers`) is left
out: the answer is then marked `"partial": true` and names the missing partitions in
`failed_shards`, instead of the whole request failing or waiting on the slowest machine.

Exactness: partition p returns its own top-k, so the merged top-k is the top-k of the
union. When every partition's candidate pool is exhaustive (nprobe = nlist and
rerank_count >= its documents) that is exactly the ranking of one index over the whole
corpus. With smaller pools each partition re-ranks its own top `rerank_count`, so the
union re-ranks S x rerank_count candidates, a superset of one index's pool.

Lexical and hybrid modes. A lexical search merges by BM25 score like a dense one. A hybrid
search cannot merge fused scores (RRF ranks and min-max normalisations are per list), so
the router asks every partition for its whole fusion pool (`k` = 1000; a partition returns
at most rerank_count + lexical_k hits) with both sides' scores, rebuilds the pool one index
would form (the top rerank_count by dense score, the top lexical_k by BM25) and fuses it
with `espn.search.hybrid.fuse`, the Searcher's own function, under the parameters the partitions
report. What remains different from one index is BM25's corpus statistics (document
frequencies, average length), which each partition computes over its own documents: with
documents spread by a hash of their ids they differ by sampling noise only. Measured on 2
partitions of 300 SciFact abstracts (tests/test_router.py): the same top-10 set on most queries, and
every routed hybrid ranking within the tolerance stated there.

Where the partitions are (`routing`): static flags (`--shards`, a partition's replicas joined
by `|`; `--writers`), or a shard map on object storage (`--shard-map`: which partition owns
each hash slot, each partition's replicas and writer, read again every few seconds). A
partition's searches go to its replicas in turn and a failed one is retried on the next.
Nothing here is a cluster manager: scheduling and restarts belong to the platform, the map and
the leases to the store, and the router only follows them.
"""

from ..router_settings import RouterSettings
from .app import build_router_app
from .merge import fuse_hits, merge_hits
from .models import RoutedBatchResponse, RoutedSearchResponse, ShardFailure

__all__ = [
    "RouterSettings",
    "ShardFailure",
    "RoutedSearchResponse",
    "RoutedBatchResponse",
    "merge_hits",
    "fuse_hits",
    "build_router_app",
]
