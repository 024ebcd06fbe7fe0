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
import time
import urllib.parse
from typing import Any, Callable, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from espn.errors import InvalidParameterError
from espn.partitioning import HASH_NAME, PartitionLayout, owner

from ..errors import METHOD_NOT_ALLOWED_ROUTE
from ..schemas import BatchWriteRequest, ErrorResponse, path_doc_id

__all__ = ["PartitionOutcome", "RoutedWriteResponse", "WriterPool", "add_write_routes"]

logger = logging.getLogger(__name__)

_FORWARDED = ("authorization", "x-request-id", "content-type")
_RETRY_AFTER_S = 2


class PartitionOutcome(BaseModel):
    partition: int
    status: int = Field(description="the writer's HTTP status (503 when it did not answer, 504 when it timed out)")
    applied: bool
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


@dataclasses.dataclass
class WriterPool:
    """The writers, one per partition, and what the router learnt of each."""

    client_of: Callable[[], httpx.AsyncClient]
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
            response = await asyncio.wait_for(self.client_of().get(url + "/readyz"), self.timeout_s)
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
            return _error(503, "layout_mismatch", message, partition=partition, retry=False)
        self.verified.add(partition)
        return None

    def _down(self, partition: int, why: str) -> JSONResponse:
        url = self.writers[partition]
        self.verified.discard(partition)
        self.on_failure(url, "writer_unavailable", why)
        return _error(503, "writer_unavailable", f"the writer of partition {partition} ({url}) is not available: "
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
                self.client_of().request(method, url + path, content=content, headers=headers,
                                         timeout=self.timeout_s), self.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            self.on_failure(url, "timeout", f"no answer within {self.timeout_s:g} s")
            return _error(504, "write_timeout", f"the writer of partition {partition} ({url}) did not answer within "
                          f"{self.timeout_s:g} s: the write may or may not have been applied", partition=partition)
        except httpx.TransportError as exc:
            return self._down(partition, f"{type(exc).__name__}: {exc}".rstrip(": "))


def _error(status: int, code: str, message: str, *, partition: int, retry: bool = True) -> JSONResponse:
    body = {**ErrorResponse(error=code, message=message, errors=None).model_dump(exclude_none=True),
            "partition": partition}
    headers = {"Retry-After": str(_RETRY_AFTER_S)} if retry and status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _body_of(answer: httpx.Response | JSONResponse) -> tuple[int, Any]:
    if isinstance(answer, JSONResponse):
        return answer.status_code, json.loads(bytes(answer.body))
    try:
        return answer.status_code, answer.json()
    except ValueError:
        return answer.status_code, {"error": "writer_error", "message": answer.text[:500]}


def _relay(answer: httpx.Response | JSONResponse, partition: int) -> JSONResponse:
    status, body = _body_of(answer)
    headers = {"X-Espn-Partition": str(partition)}
    retry_after = answer.headers.get("retry-after")
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    return JSONResponse(body, status_code=status, headers=headers)


def add_write_routes(app: FastAPI, pool: Callable[[], WriterPool], observe: Callable[[str, float, int], None]) -> None:
    """PUT, DELETE and batch writes on `app`, placed by id (see the module doc)."""

    def headers_of(request: Request) -> dict[str, str]:
        return {name: request.headers[name] for name in _FORWARDED if name in request.headers}

    async def single(request: Request, method: str) -> JSONResponse:
        started = time.perf_counter()
        try:
            doc_id = path_doc_id(request)
        except InvalidParameterError as exc:
            return JSONResponse({"error": "invalid_parameter", "message": str(exc)}, status_code=422)
        writers = pool()
        partition = writers.owner(doc_id)
        path = "/v1/documents/" + urllib.parse.quote(doc_id, safe="")
        answer = await writers.send(partition, method, path, headers_of(request), await request.body())
        response = _relay(answer, partition)
        observe("write", started, response.status_code)
        return response

    @app.api_route("/v1/documents/batch", methods=["GET", "PUT", "DELETE"], include_in_schema=False,
                   name=METHOD_NOT_ALLOWED_ROUTE)
    async def batch_other_methods(request: Request) -> JSONResponse:
        return JSONResponse({"error": "method_not_allowed", "message": f"method {request.method} is not allowed on "
                             "/v1/documents/batch; it takes POST"}, status_code=405, headers={"Allow": "POST"})

    @app.post("/v1/documents/batch", response_model=RoutedWriteResponse,
              summary="Upserts and deletes, each part applied on the partition that owns its ids",
              responses={422: {"model": ErrorResponse}, 503: {"model": RoutedWriteResponse}})
    async def write_batch(request: Request) -> JSONResponse:
        started = time.perf_counter()
        try:
            body = BatchWriteRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
            return JSONResponse({"error": "invalid_request", "message": "the request does not match the schema",
                                 "errors": errors}, status_code=422)
        writers = pool()
        parts: dict[int, dict[str, list[Any]]] = {}
        for document in body.upsert:
            parts.setdefault(writers.owner(document.id), {"upsert": [], "delete": []})["upsert"].append(
                document.model_dump(exclude_none=True))
        for doc_id in body.delete:
            parts.setdefault(writers.owner(doc_id), {"upsert": [], "delete": []})["delete"].append(doc_id)
        order = sorted(parts)
        headers = {**headers_of(request), "content-type": "application/json"}
        answers = await asyncio.gather(*(
            writers.send(p, "POST", "/v1/documents/batch", headers, json.dumps(parts[p], ensure_ascii=False).encode())
            for p in order))
        outcomes, created, replaced, deleted = [], [], [], []
        for p, answer in zip(order, answers):
            status, reply = _body_of(answer)
            applied = status == 200 and isinstance(reply, dict) and "generation" in reply
            if applied:
                created += reply["created"]
                replaced += reply["replaced"]
                deleted += reply["deleted"]
            outcomes.append(PartitionOutcome(
                partition=p, status=status, applied=applied, generation=reply.get("generation") if applied else None,
                upserts=[d["id"] for d in parts[p]["upsert"]], deletes=parts[p]["delete"],
                error=None if applied else str(reply.get("error", "writer_error")),
                message=None if applied else str(reply.get("message", ""))))
        failed = [o for o in outcomes if not o.applied]
        result = RoutedWriteResponse(created=created, replaced=replaced, deleted=deleted,
                                     applied=[o.partition for o in outcomes if o.applied],
                                     failed=[o.partition for o in failed], partitions=outcomes)
        # All applied: 200. Otherwise the first failed part's status, so a client that reads
        # only the status still sees the write did not all happen; the body says which did.
        status = 200 if not failed else failed[0].status
        headers_out = {"Retry-After": str(_RETRY_AFTER_S)} if status == 503 else None
        observe("batch_write", started, status)
        return JSONResponse(result.model_dump(mode="json"), status_code=status, headers=headers_out)

    @app.put("/v1/documents/{doc_id:path}", summary="Add or replace a document on the partition that owns its id",
             responses={503: {"model": ErrorResponse}, 504: {"model": ErrorResponse}})
    async def put_document(doc_id: str, request: Request) -> JSONResponse:
        return await single(request, "PUT")

    @app.delete("/v1/documents/{doc_id:path}", summary="Delete a document on the partition that owns its id",
                responses={503: {"model": ErrorResponse}, 504: {"model": ErrorResponse}})
    async def delete_document(doc_id: str, request: Request) -> JSONResponse:
        return await single(request, "DELETE")
