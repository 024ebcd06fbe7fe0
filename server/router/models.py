"""What the router answers: the server's response models, plus what routing adds
(which partitions answered, what each write part did)."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, Field

from ..schemas import QueryError, SearchHit, SearchResponse

__all__ = ["ShardFailure", "RoutedStats", "RoutedSearchResponse", "RoutedSearchAnswer", "RoutedBatchResponse",
           "ShardsBatch", "PartitionOutcome", "RoutedWriteResponse"]


class ShardFailure(BaseModel):
    shard: str = Field(description="base URL of the partition that did not answer")
    error: str = Field(description="timeout, unreachable, http_<status>, bad_response (not the answer asked for: "
                                   "the wrong shape, a non-finite score, more hits than k) or too_large (over the "
                                   "router's byte limit on an answer)")
    message: str


class RoutedStats(BaseModel):
    """The partitions' stats combined: time is the slowest partition's (they run at once),
    counts are sums."""

    stage_ms: dict[str, float] = Field(description="per stage, the maximum over the partitions that answered")
    queue_ms: float
    batch_size: int
    hit_rate: float = Field(description="mean over the partitions that answered")
    bytes_read: int
    ios: int
    prefetched: int
    missed: int
    shards_answered: int
    shards_total: int
    route_ms: float = Field(description="milliseconds in the router, fan-out to merged answer")
    syntax: Optional[str] = Field(default=None, description="lexical and hybrid: how the query was read")
    ignored: Optional[list[str]] = Field(default=None, description="syntax simple: what was read as text instead "
                                                                   "(as each partition reads it alike)")


class RoutedSearchResponse(BaseModel):
    query: str
    results: list[SearchHit]
    stats: RoutedStats
    partial: bool = Field(description="true when a partition's results are missing")
    failed_shards: list[ShardFailure]


class RoutedSearchAnswer(RoutedSearchResponse):
    index: int = Field(description="the query's position in the request")


class RoutedBatchResponse(BaseModel):
    responses: list[RoutedSearchAnswer] = Field(description="the answered queries, in request order")
    errors: list[QueryError] = Field(default_factory=list, description="one per query the partitions could not "
                                                                       "search; the others are answered")
    partial: bool
    failed_shards: list[ShardFailure]


class ShardsBatch(BaseModel):
    """What a shard's /v1/search/batch answers (validated: a garbled answer is a failure)."""

    responses: list[SearchResponse]
    errors: list[QueryError] = []  # absent from shards that predate per-query errors

    def by_index(self) -> dict[int, SearchResponse]:
        """The answered queries by position (a shard without `index` answered every query, in order)."""
        return {i if r.index is None else r.index: r for i, r in enumerate(self.responses)}


class PartitionOutcome(BaseModel):
    partition: int
    status: int = Field(description="the writer's HTTP status (503 when it did not answer, 504 when it timed out, "
                                    "502 when its answer was not the write result of the ids sent)")
    applied: bool = Field(description="true only when the writer's answer listed this part's ids as written")
    generation: Optional[int] = Field(None, description="the generation the part published on its partition")
    upserts: list[str] = Field(description="ids this part upserted (or would have)")
    deletes: list[str] = Field(description="ids this part deleted (or would have)")
    error: Optional[str] = None
    message: Optional[str] = None


class RoutedWriteResponse(BaseModel):
    created: list[str]
    replaced: list[str]
    deleted: list[str]
    applied: list[int] = Field(description="partitions that published their part")
    failed: list[int] = Field(description="partitions whose part was not applied (retry just those parts)")
    partitions: list[PartitionOutcome]
