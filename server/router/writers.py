"""Writes through the router: each id to the writer of the partition that owns it.

With `--writers` (one URL per partition, in partition order, beside `--shards`), the
router takes PUT and DELETE /v1/documents/{id} and POST /v1/documents/batch. The owner
of an id is `espn.partitioning.owner(id, S)`: the rule the build placed every document by
and each partition's manifest records. Before its first write to a writer the router reads
that writer's /readyz and checks it reports partition p of S under the same rule; a writer
that reports anything else gets no write (a swapped URL would scatter ids for good).

A batch is split by owner and each part is sent to its writer at once; every part is one
generation on its partition (all or nothing there), and parts on different partitions are
independent. The answer lists every partition's outcome with the ids it held, so a caller
retries exactly the parts that failed. A writer that does not answer makes its part a 503
with Retry-After; its partition's followers go on serving searches. A write that timed out
may or may not have been applied: that is a 504 saying so (PUT is safe to repeat).

A write is acknowledged only when the writer's answer checks (`.answers.check_write`): a 200
or 201 whose body is the server's write result, listing exactly the ids sent, read within
MAX_SMALL_ANSWER_BYTES. Anything else that claims success (an HTML page from a proxy, a
result without its lists or with other ids, an answer past the limit) is a 502 `bad_gateway`
naming the partition and saying the write is not confirmed; a writer's own refusal (4xx, or
502, 503, 504, 507) is passed on with the partition added; any other status (a 500, a 3xx)
is a 502. A batch is 200 only when every part checked.

`GET /v1/documents/{id}` goes to the owner's search address only (its followers).

With a shard map (`--shard-map`, `.routing.MapRouting`) the owner is the map's and the writer
is the holder of the partition's lease; there is no /readyz check (each writer checks the ids
against the same map), and a writer that says it is not the partition's writer (any more), or
that cannot be reached, makes the router read the map and the leases again and send the write
once more when another writer holds the partition now.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Callable, Optional

import httpx
from fastapi.responses import JSONResponse

from espn.engine import PARTITIONS

from ..schemas import ErrorResponse, WriteResponse
from .answers import (MAX_SMALL_ANSWER_BYTES, AnswerTooLarge, BadAnswer, PartitionAnswer, check_readiness, check_write,
                      error_body, fetch, retry_after)
from .index_path import shard_path
from .routing import MapRouting, StaticRouting

__all__ = ["RETRY_AFTER_S", "PASSED_ON", "NOT_THE_WRITER", "WriteOutcome", "WriterPool", "relay", "writer_error"]

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 2

# A writer's answers that mean another process writes its partition now (nothing was applied):
# with a shard map the router looks for that writer and sends the write there once more.
NOT_THE_WRITER = frozenset({"writer_standby", "writer_superseded", "writer_unavailable"})

# A writer's statuses passed on to the client as they are: its refusals (4xx) and what says
# it could not take the write now (a gateway error, unavailable, a timeout, a full disk).
# A 500 (a bug), a 501, a 3xx or an unknown status is the router's 502 naming the partition.
PASSED_ON = frozenset(range(400, 500)) | {502, 503, 504, 507}


@dataclasses.dataclass(frozen=True)
class WriteOutcome:
    """What became of one write on one partition: `result` only when the writer's answer
    checked as the write applied; otherwise `body` is an error body naming the partition."""

    partition: int
    status: int
    body: dict[str, Any]
    result: Optional[WriteResponse] = None
    retry_after: Optional[str] = None

    @property
    def applied(self) -> bool:
        return self.result is not None


@dataclasses.dataclass
class WriterPool:
    """The writers, one per partition (`routing`: the flags' or a shard map's), and what the router
    learnt of each."""

    client: httpx.AsyncClient
    routing: StaticRouting | MapRouting
    timeout_s: float
    on_failure: Callable[[str, str, str], object]
    verified: set[int] = dataclasses.field(default_factory=set)

    @property
    def count(self) -> int:
        return self.routing.partition_count()

    def owner(self, doc_id: str) -> int:
        return self.routing.owner(doc_id)

    def _url(self, partition: int) -> str:
        return self.routing.writer(partition) or f"(no writer holds partition {partition}'s lease)"

    async def _get(self, partition: int, method: str, path: str, headers: Optional[dict[str, str]] = None,
                   content: Optional[bytes] = None) -> PartitionAnswer | WriteOutcome:
        """The writer's answer within the time and byte limits, or the router's own outcome
        (503 unreachable, 504 timed out, 502 over the byte limit or undecodable)."""
        url = self.routing.writer(partition)
        if url is None:
            return self._down(partition, "no writer holds its lease (a standby takes it over within a lease length)")
        try:
            return await asyncio.wait_for(
                fetch(self.client, method, url + shard_path(path), headers=headers, content=content,
                      max_bytes=MAX_SMALL_ANSWER_BYTES, timeout_s=self.timeout_s), self.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            self.on_failure(url, "timeout", f"no answer within {self.timeout_s:g} s")
            return writer_error(504, "write_timeout", (
                f"the writer of partition {partition} ({url}) did not answer {path} within {self.timeout_s:g} s: "
                "the write may or may not have been applied"), partition=partition)
        except httpx.TransportError as exc:
            return self._down(partition, f"{type(exc).__name__}: {exc}".rstrip(": "))
        except (AnswerTooLarge, httpx.DecodingError) as exc:
            return self._bad(partition, path, str(exc))

    async def _verify(self, partition: int, headers: dict[str, str]) -> Optional[WriteOutcome]:
        """None when the writer reports partition p of S by the hash rule; else the outcome to give.
        headers: the write's own (its API key: a server with keys tells its layout only to a key).
        A shard map's writers check the ids against its slots themselves."""
        if partition in self.verified or not self.routing.checks_layout:
            return None
        url = self._url(partition)
        key = {name: value for name, value in headers.items() if name.lower() == "authorization"}
        answer = await self._get(partition, "GET", "/readyz", key or None)
        if isinstance(answer, WriteOutcome):
            return answer
        if answer.status != 200:
            return self._down(partition, f"/readyz answered {answer.status}")
        try:
            reported = check_readiness(answer)
        except BadAnswer as exc:
            return self._bad(partition, "/readyz", str(exc), applied="no write was sent")
        expected = PARTITIONS.layout(partition, self.count)
        if reported is None or PARTITIONS.layout(reported.index, reported.count, reported.by) != expected:
            says = ("reports no partition" if reported is None else
                    f"reports partition {reported.index} of {reported.count} by "
                    f"{None if reported.by is None else reported.by[:80]!r}")
            message = (f"writer {url} {says}; this router has it as partition {partition} of {self.count} by "
                       f"{PARTITIONS.hash_name!r}: check --writers (one URL per partition, in partition order) and the index "
                       "it serves")
            self.on_failure(url, "layout_mismatch", message)
            return writer_error(503, "layout_mismatch", message, partition=partition)
        self.verified.add(partition)
        return None

    def _down(self, partition: int, why: str) -> WriteOutcome:
        url = self._url(partition)
        self.verified.discard(partition)
        self.on_failure(url, "writer_unavailable", why)
        return writer_error(503, "writer_unavailable", f"the writer of partition {partition} ({url}) is not "
                            f"available: {why}; searches go on, retry the write", partition=partition,
                            retry_after=str(RETRY_AFTER_S))

    def _bad(self, partition: int, path: str, why: str,
             applied: str = "the write is not confirmed and may or may not have been applied; retry it") -> WriteOutcome:
        url = self._url(partition)
        self.verified.discard(partition)  # check its layout again before the next write
        self.on_failure(url, "bad_response", f"{path}: {why}")
        return writer_error(502, "bad_gateway", f"the writer of partition {partition} ({url}) answered {path} "
                            f"with what is not its answer: {why}; {applied}", partition=partition)

    async def write(self, partition: int, method: str, path: str, headers: dict[str, str], content: bytes,
                    upserts: list[str], deletes: list[str]) -> WriteOutcome:
        """Send one write to its partition's writer; applied only when the answer lists exactly
        `upserts` and `deletes` as written (see the module doc for the statuses). With a shard
        map, a writer that says it is not the partition's writer (any more), or that cannot be
        reached, makes the router read the map again; the write goes once more when another
        writer holds the partition now (nothing of it was applied by the first)."""
        outcome = await self._write_once(partition, method, path, headers, content, upserts, deletes)
        if self.routing.checks_layout or outcome.body.get("error") not in NOT_THE_WRITER:
            return outcome
        before = self.routing.writer(partition)
        await self.routing.refresh()
        if self.routing.writer(partition) in (None, before):
            return outcome
        return await self._write_once(partition, method, path, headers, content, upserts, deletes)

    async def _write_once(self, partition: int, method: str, path: str, headers: dict[str, str], content: bytes,
                          upserts: list[str], deletes: list[str]) -> WriteOutcome:
        refused = await self._verify(partition, headers)
        if refused is not None:
            return refused
        answer = await self._get(partition, method, path, headers, content)
        if isinstance(answer, WriteOutcome):
            return answer
        if 200 <= answer.status < 300:
            try:
                result = check_write(answer, upserts, deletes)
            except BadAnswer as exc:
                return self._bad(partition, path, str(exc))
            # PUT: 201 when it created the document, as the server says it.
            status = 201 if method == "PUT" and result.created else 200
            return WriteOutcome(partition, status, result.model_dump(mode="json"), result)
        if answer.status in PASSED_ON:
            body = {**error_body(answer, "writer_error"), "partition": partition}
            default = RETRY_AFTER_S if answer.status == 503 else None
            return WriteOutcome(partition, answer.status, body, retry_after=retry_after(answer, default))
        return self._bad(partition, path, f"HTTP {answer.status} ({error_body(answer, 'writer_error')['message'][:200]})")


def writer_error(status: int, code: str, message: str, *, partition: int,
                 retry_after: Optional[str] = None) -> WriteOutcome:
    """The router's own outcome for a write it could not confirm: the API's error body, with the partition."""
    body = {**ErrorResponse(error=code, message=message, errors=None).model_dump(exclude_none=True),
            "partition": partition}
    return WriteOutcome(partition, status, body, retry_after=retry_after)


def relay(outcome: WriteOutcome) -> JSONResponse:
    """A single write's outcome as the answer: the checked write result, or the error body."""
    headers = {"X-Espn-Partition": str(outcome.partition)}
    if outcome.retry_after is not None:
        headers["Retry-After"] = outcome.retry_after
    return JSONResponse(outcome.body, status_code=outcome.status, headers=headers)
