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

`GET /v1/documents/{id}` goes to the owner's search address only (its followers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any, Callable, Optional

import httpx
from fastapi.responses import JSONResponse

from espn.partitioning import HASH_NAME, PartitionLayout, owner

from ..schemas import ErrorResponse

__all__ = ["RETRY_AFTER_S", "WriterPool", "body_of", "relay", "writer_error"]

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 2


@dataclasses.dataclass
class WriterPool:
    """The writers, one per partition, and what the router learnt of each."""

    client: httpx.AsyncClient
    writers: list[str]
    timeout_s: float
    on_failure: Callable[[str, str, str], object]
    verified: set[int] = dataclasses.field(default_factory=set)

    @property
    def count(self) -> int:
        return len(self.writers)

    def owner(self, doc_id: str) -> int:
        return owner(doc_id, self.count)

    async def _verify(self, partition: int) -> Optional[JSONResponse]:
        """None when the writer reports partition p of S by the hash rule; else the answer to give."""
        if partition in self.verified:
            return None
        url = self.writers[partition]
        try:
            response = await asyncio.wait_for(self.client.get(url + "/readyz"), self.timeout_s)
        except (asyncio.TimeoutError, httpx.TransportError) as exc:
            return self._down(partition, f"{type(exc).__name__}: {exc}".rstrip(": "))
        if response.status_code != 200:
            return self._down(partition, f"/readyz answered {response.status_code}")
        try:
            reported = response.json().get("partition") or {}
        except ValueError:
            reported = {}
        layout = PartitionLayout(reported.get("index", -1), reported.get("count", -1), reported.get("by"))
        expected = PartitionLayout(partition, self.count)
        if layout != expected:
            message = (f"writer {url} reports partition {layout.index} of {layout.count} by {layout.by!r}; this router "
                       f"has it as partition {partition} of {self.count} by {HASH_NAME!r}: check --writers "
                       "(one URL per partition, in partition order) and the index it serves")
            self.on_failure(url, "layout_mismatch", message)
            return writer_error(503, "layout_mismatch", message, partition=partition, retry=False)
        self.verified.add(partition)
        return None

    def _down(self, partition: int, why: str) -> JSONResponse:
        url = self.writers[partition]
        self.verified.discard(partition)
        self.on_failure(url, "writer_unavailable", why)
        return writer_error(503, "writer_unavailable", f"the writer of partition {partition} ({url}) is not available: "
                      f"{why}; searches go on, retry the write", partition=partition)

    async def send(self, partition: int, method: str, path: str, headers: dict[str, str],
                   content: bytes) -> httpx.Response | JSONResponse:
        """The writer's answer, or the router's own (503 down or misconfigured, 504 timed out)."""
        refused = await self._verify(partition)
        if refused is not None:
            return refused
        url = self.writers[partition]
        try:
            return await asyncio.wait_for(
                self.client.request(method, url + path, content=content, headers=headers,
                                         timeout=self.timeout_s), self.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            self.on_failure(url, "timeout", f"no answer within {self.timeout_s:g} s")
            return writer_error(504, "write_timeout", f"the writer of partition {partition} ({url}) did not answer within "
                          f"{self.timeout_s:g} s: the write may or may not have been applied", partition=partition)
        except httpx.TransportError as exc:
            return self._down(partition, f"{type(exc).__name__}: {exc}".rstrip(": "))


def writer_error(status: int, code: str, message: str, *, partition: int, retry: bool = True) -> JSONResponse:
    body = {**ErrorResponse(error=code, message=message, errors=None).model_dump(exclude_none=True),
            "partition": partition}
    headers = {"Retry-After": str(RETRY_AFTER_S)} if retry and status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


def body_of(answer: httpx.Response | JSONResponse) -> tuple[int, Any]:
    if isinstance(answer, JSONResponse):
        return answer.status_code, json.loads(bytes(answer.body))
    try:
        return answer.status_code, answer.json()
    except ValueError:
        return answer.status_code, {"error": "writer_error", "message": answer.text[:500]}


def relay(answer: httpx.Response | JSONResponse, partition: int) -> JSONResponse:
    status, body = body_of(answer)
    headers = {"X-Espn-Partition": str(partition)}
    retry_after = answer.headers.get("retry-after")
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    return JSONResponse(body, status_code=status, headers=headers)
