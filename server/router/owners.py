"""Each id answered once while a reshard moves it: with a shard map, a partition's hits count only
for the ids whose slot it owns (`.routing.MapRouting.owned`).

For a moment during a move a document is in two partitions: the target holds its copy before
the switch, the source until it drops its own after. A single search that lost hits this way
asks that partition again for as many more (at most MAX_REASKS times), so its top-k stays the
partition's top-k of the documents it owns. A batch is filtered only: within the seconds around
a switch a query of a batch may come back short of the moved documents that ranked last.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..schemas import MAX_EXPLAIN_K, MAX_HTTP_K, SearchResponse
from .answers import check_search
from .fanout import Fanout
from .models import ShardsBatch
from .routing import MapRouting, StaticRouting, Target

__all__ = ["MAX_REASKS", "owned_hits", "owned_batches"]

MAX_REASKS = 3


def _owned(routing: StaticRouting | MapRouting, target: Target, response: SearchResponse) -> list[bool] | None:
    owned = routing.owned(target.partition, [hit.id for hit in response.results])
    return None if owned is None else owned.tolist()


async def owned_hits(fanout: Fanout, routing: StaticRouting | MapRouting,
                     answered: Sequence[tuple[Target, SearchResponse]], asked: dict[str, Any],
                     headers: dict[str, str]) -> list[SearchResponse]:
    """The partitions' answers to one search, each holding only the hits of ids it owns."""
    out = []
    limit = MAX_EXPLAIN_K if asked.get("explain") else MAX_HTTP_K
    for target, response in answered:
        owned = _owned(routing, target, response)
        k = int(asked.get("k", 10))
        for _ in range(MAX_REASKS):
            if owned is None or all(owned) or len(response.results) < k or k >= limit or asked.get("mode") == "hybrid":
                break  # nothing lost, or the partition gave all it holds: nothing more to ask
            k = min(limit, k + owned.count(False))
            again = await fanout.ask(target, "/v1/search", {**asked, "k": k}, headers, check_search)
            if not isinstance(again, SearchResponse):
                break  # the replicas failed this time: what the first answer owns stands
            response, owned = again, _owned(routing, target, again)
        if owned is not None and not all(owned):
            response = response.model_copy(update={"results": [h for h, mine in zip(response.results, owned) if mine]})
        out.append(response)
    return out


def owned_batches(routing: StaticRouting | MapRouting,
                  answered: Sequence[tuple[Target, ShardsBatch]]) -> list[ShardsBatch]:
    """The partitions' answers to a batch, each query's hits filtered to the ids the partition owns."""
    out = []
    for target, batch in answered:
        responses = []
        for response in batch.responses:
            owned = _owned(routing, target, response)
            if owned is not None and not all(owned):
                response = response.model_copy(update={"results": [h for h, o in zip(response.results, owned) if o]})
            responses.append(response)
        out.append(batch.model_copy(update={"responses": responses}))
    return out
