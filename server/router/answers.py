"""A partition's answer, read bounded and checked before anything of it reaches a client.

A partition (or a proxy in front of it) is outside the router: what it sends is data. Every
answer is streamed and the read stops past a stated byte limit (a partition streaming a
gigabyte costs the router at most the limit, not the gigabyte); JSON is parsed only after its
depth is checked (`espn.untrusted.load_json`), with every number finite; and it is then
validated against the server's own schema (`..schemas`) plus what the router asked for: ids
that match the write sent, no more hits than `k`, one answer per query of a batch, scores a
float32 can hold. What fails any check is `BadAnswer`, one line naming the rule, which the
caller turns into a failed partition (searches: partial) or a 502 (writes): never a 500.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Optional, TypeVar

import httpx
import numpy as np
from pydantic import BaseModel, StrictInt, StrictStr, ValidationError

from espn.errors import InvalidParameterError
from espn.engine import PARTITIONS, RULES

from ..schemas import DocumentResponse, ErrorResponse, ReadinessResponse, SearchResponse, WriteResponse
from .models import ShardsBatch

__all__ = ["MAX_ANSWER_BYTES", "MAX_SMALL_ANSWER_BYTES", "AnswerTooLarge", "BadAnswer", "PartitionAnswer",
           "ReportedLayout", "check_batch", "check_document", "check_readiness", "check_search", "check_write",
           "error_body", "fetch"]

M = TypeVar("M", bound=BaseModel)

MAX_ANSWER_BYTES = 64 << 20
"""The most bytes the router reads of one partition's search or document answer (64 MiB).

Far above what a partition sends in normal use: a search at k = 1000 with `return_text` over
abstracts is a few MB, a batch of 1,000 queries at k = 10 without text about 2 MB, a whole
hybrid pool (k = 1000 per query) of 100 queries about 20 MB. The router holds every
partition's answer at once (and the parsed objects, several times the bytes), so this bounds
what S partitions can make it hold to S x 64 MiB of text. Measured with one partition
streaming 1 GiB: unbounded, the router's peak RSS grew by 2,133 MiB (the body, then a joined
copy) over 24 s; bounded, by 61 MiB in under a second (tests/test_router_trust.py). An answer
over it fails that partition (`too_large`, naming the limit); a batch that legitimately
needs more should be split."""

MAX_SMALL_ANSWER_BYTES = 4 << 20
"""The most bytes the router reads of a write result, a /readyz or an error body (4 MiB).

The largest write result lists 1,000 upserted and 1,000 deleted ids (MAX_BATCH_WRITES) of at
most 128 characters, at most 4 bytes each in UTF-8: about 1 MB with the JSON around it."""

# A score is computed in float32 by the server: a larger magnitude is not a score, and would
# become infinite when the router fuses hybrid pools in float32.
_MAX_SCORE = float(np.finfo(np.float32).max)
_SCORES = ("score", "cls_score", "bow_score", "dense_score", "lexical_score")
_MAX_RERANK_COUNT = 1 << 20


class BadAnswer(Exception):
    """A partition answered something that is not what was asked: one line naming the rule."""


class AnswerTooLarge(BadAnswer):
    """A partition's answer went past the byte limit; the read stopped there."""


@dataclasses.dataclass(frozen=True)
class PartitionAnswer:
    """A partition's answer, read whole but never past its limit."""

    status: int
    content: bytes
    retry_after: Optional[str]  # as the partition sent it: see `retry_after`
    reason: str

    def text(self, limit: int = 500) -> str:
        return self.content[:limit].decode("utf-8", "replace")


async def fetch(client: httpx.AsyncClient, method: str, url: str, *, max_bytes: int,
                headers: Optional[dict[str, str]] = None, json: Any = None, content: Optional[bytes] = None,
                timeout_s: Optional[float] = None) -> PartitionAnswer:
    """The answer to one request, streamed and cut off past `max_bytes` (decoded bytes):
    AnswerTooLarge then, and the connection is closed rather than drained. httpx's own
    exceptions (timeouts, transport errors, a body that does not decode) pass through."""
    extra: dict[str, Any] = {} if timeout_s is None else {"timeout": timeout_s}
    request = client.build_request(method, url, headers=headers, json=json, content=content, **extra)
    response = await client.send(request, stream=True)
    try:
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise AnswerTooLarge(f"answered {int(declared)} bytes (Content-Length); the router reads at most "
                                 f"{max_bytes} bytes of an answer")
        chunks: list[bytes] = []
        total = 0
        async for chunk in response.aiter_bytes():
            total += len(chunk)
            if total > max_bytes:
                raise AnswerTooLarge(f"answered more than {max_bytes} bytes; the router reads at most {max_bytes} "
                                     "bytes of an answer and stopped there")
            chunks.append(chunk)
    finally:
        await response.aclose()
    return PartitionAnswer(response.status_code, b"".join(chunks), response.headers.get("retry-after"),
                           response.reason_phrase)


def retry_after(answer: PartitionAnswer, default: Optional[int] = None) -> Optional[str]:
    """The partition's Retry-After when it is a plain number of seconds (an HTTP date or
    anything else is replaced by `default`)."""
    value = (answer.retry_after or "").strip()
    if value.isdigit() and len(value) <= 6:
        return value
    return None if default is None else str(default)


def _parse(answer: PartitionAnswer, model: type[M], what: str, *, strict: bool = False) -> M:
    data = RULES.load_json(answer.content, what, max_bytes=len(answer.content), finite=True, error=BadAnswer)
    try:
        return model.model_validate(data, strict=strict)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the body"
        raise BadAnswer(f"{what}: not {model.__name__} ({exc.error_count()} error(s); {where}: {first['msg']})") from None


def error_body(answer: PartitionAnswer, fallback: str) -> dict[str, Any]:
    """An error answer as the API's error body: the partition's own when it has that shape,
    else `fallback` as the code with the start of its text as the message."""
    try:
        return _parse(answer, ErrorResponse, "error body").model_dump(exclude_none=True)
    except BadAnswer:
        return {"error": fallback, "message": answer.text() or answer.reason or f"HTTP {answer.status}"}


def check_write(answer: PartitionAnswer, upserts: list[str], deletes: list[str]) -> WriteResponse:
    """The write result of a 200/201 answer, when it lists exactly the ids sent: upserts as
    created or replaced, deletes as deleted, and a generation that published them."""
    if answer.status not in (200, 201):
        raise BadAnswer(f"answered {answer.status} to a write (a write is applied with 200 or 201)")
    result = _parse(answer, WriteResponse, "write result", strict=True)
    if result.generation < 1:
        raise BadAnswer(f"write result: generation {result.generation} (a write publishes generation 1 or later)")
    written = collections.Counter(result.created + result.replaced)
    if written != collections.Counter(upserts) or collections.Counter(result.deleted) != collections.Counter(deletes):
        raise BadAnswer(f"write result: lists {sum(written.values())} upserted and {len(result.deleted)} deleted "
                        f"id(s) other than the {len(upserts)} and {len(deletes)} sent")
    return result


class ReportedLayout(BaseModel):
    """The `partition` section of a writer's /readyz."""

    index: StrictInt
    count: StrictInt
    by: Optional[StrictStr] = None


def check_readiness(answer: PartitionAnswer) -> Optional[ReportedLayout]:
    """The partition a ready server reports (None: it reports none)."""
    ready = _parse(answer, ReadinessResponse, "/readyz")
    if ready.partition is None:
        return None
    try:
        return ReportedLayout.model_validate(ready.partition, strict=True)
    except ValidationError as exc:
        raise BadAnswer(f"/readyz: its partition section is not index, count and by ({exc.error_count()} "
                        "error(s))") from None


def check_document(answer: PartitionAnswer, doc_id: str) -> DocumentResponse:
    document = _parse(answer, DocumentResponse, "document")
    if document.id != doc_id:
        raise BadAnswer(f"document: asked for id {doc_id[:100]!r}, answered id {document.id[:100]!r}")
    return document


def check_search(answer: PartitionAnswer, asked: dict[str, Any]) -> SearchResponse:
    """A /v1/search answer to `asked` (the body sent to the partitions)."""
    response = _parse(answer, SearchResponse, "search answer")
    _check_response(response, asked, "search answer")
    return response


def check_batch(answer: PartitionAnswer, asked: dict[str, Any]) -> ShardsBatch:
    """A /v1/search/batch answer: each query of `asked` answered or refused once, by position."""
    batch = _parse(answer, ShardsBatch, "batch answer")
    count = len(asked["queries"])
    answered = batch.by_index()
    refused = [error.index for error in batch.errors]
    positions = sorted(list(answered) + refused)
    if len(answered) != len(batch.responses) or positions != list(range(count)):
        raise BadAnswer(f"batch answer: {len(batch.responses)} answer(s) and {len(refused)} error(s) that are not "
                        f"one per query of the {count} asked")
    for i, response in answered.items():
        _check_response(response, asked, f"batch answer, query {i}")
    return batch


def _check_response(response: SearchResponse, asked: dict[str, Any], what: str) -> None:
    k = int(asked.get("k", 10))
    # A hybrid partition returns its whole fusion pool (see merge.fan_out_body), not k hits.
    if asked.get("mode") != "hybrid" and len(response.results) > k:
        raise BadAnswer(f"{what}: {len(response.results)} results, more than k = {k}")
    for rank, hit in enumerate(response.results):
        for name in _SCORES:
            value = getattr(hit, name)
            if value is not None and not abs(value) <= _MAX_SCORE:
                raise BadAnswer(f"{what}: results[{rank}].{name} = {value!r} is not a float32 score")
    stats = response.stats
    if not 0.0 <= stats.hit_rate <= 1.0:
        raise BadAnswer(f"{what}: stats.hit_rate = {stats.hit_rate!r} is not in [0, 1]")
    if stats.mode == "hybrid" and stats.hybrid:
        try:
            PARTITIONS.hybrid_params(stats.hybrid)
        except (InvalidParameterError, TypeError, ValueError) as exc:
            raise BadAnswer(f"{what}: stats.hybrid is not fusion parameters ({str(exc)[:200]})") from None
        rerank_count = stats.hybrid.get("rerank_count", 0)
        if isinstance(rerank_count, bool) or not isinstance(rerank_count, int) or not (
                0 <= rerank_count <= _MAX_RERANK_COUNT):
            raise BadAnswer(f"{what}: stats.hybrid.rerank_count = {str(rerank_count)[:40]} is not a count")
