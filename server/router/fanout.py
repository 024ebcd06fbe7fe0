"""Calling the partitions: one request to every shard at once, each bounded in time; what
failed is counted and named, never raised (a missing partition makes an answer partial)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Optional

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel, ValidationError

from .models import ShardFailure

__all__ = ["CALLER_ERRORS", "ClientError", "Fanout", "RouterMetrics", "json_or_text", "shard_message"]

logger = logging.getLogger(__name__)

# Statuses that mean the request itself is wrong: every partition would say the same, so
# the caller gets it as is. Any other failure (404 from a misconfigured URL, 408, 429, 5xx)
# is the partition's problem and only makes the answer partial.
CALLER_ERRORS = frozenset({400, 401, 403, 413, 415, 422})


class ClientError(Exception):
    """A shard refused the request itself (a status in CALLER_ERRORS): passed on."""

    def __init__(self, status_code: int, body: Any) -> None:
        super().__init__(f"shard answered {status_code}")
        self.status_code, self.body = status_code, body


class RouterMetrics:
    """Per-app registry, so two routers (or a router and a server) in one process never
    collide on metric names."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("espn_router_requests_total", "Requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.latency = Histogram("espn_router_request_seconds", "Time from request to merged answer",
                                 ["endpoint"], registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.partial = Counter("espn_router_partial_responses_total", "Answers with a partition missing",
                               ["endpoint"], registry=self.registry)
        self.shard_failures = Counter("espn_router_shard_failures_total", "Shard calls that failed, by reason",
                                      ["shard", "error"], registry=self.registry)


@dataclasses.dataclass
class Fanout:
    """The shards, the client that calls them, and how long each call may take."""

    client: httpx.AsyncClient
    shards: list[str]
    timeout_s: float
    metrics: RouterMetrics

    async def call(self, shard: str, method: str, path: str, headers: dict[str, str],
                   json_body: Optional[dict[str, Any]]) -> httpx.Response | ShardFailure:
        try:
            # wait_for bounds the whole exchange (connect, queueing for a pooled connection,
            # response), which httpx's per-phase timeouts alone do not.
            response = await asyncio.wait_for(
                self.client.request(method, shard + path, json=json_body, headers=headers), self.timeout_s
            )
        except (asyncio.TimeoutError, httpx.TimeoutException):
            return self.record_failure(shard, "timeout", f"no answer within {self.timeout_s * 1000:.0f} ms")
        except httpx.TransportError as exc:
            return self.record_failure(shard, "unreachable", f"{type(exc).__name__}: {exc}")
        return response

    def record_failure(self, shard: str, error: str, message: str) -> ShardFailure:
        self.metrics.shard_failures.labels(shard=shard, error=error).inc()
        logger.warning("shard %s failed: %s (%s)", shard, error, message)
        return ShardFailure(shard=shard, error=error, message=message)

    async def search(self, path: str, body: dict[str, Any], headers: dict[str, str],
                     model: type[BaseModel]) -> tuple[list[Any], list[ShardFailure]]:
        """POST `body` to every shard at once; returns (parsed answers, failures)."""
        calls = [self.call(shard, "POST", path, headers, body) for shard in self.shards]
        answers: list[Any] = []
        failures: list[ShardFailure] = []
        client_errors: list[ClientError] = []
        for shard, outcome in zip(self.shards, await asyncio.gather(*calls)):
            if isinstance(outcome, ShardFailure):
                failures.append(outcome)
                continue
            status = outcome.status_code
            if status in CALLER_ERRORS:
                client_errors.append(ClientError(status, json_or_text(outcome)))
                continue
            if status != 200:
                failures.append(self.record_failure(shard, f"http_{status}", shard_message(outcome)))
                continue
            try:
                answers.append(model.model_validate_json(outcome.content))
            except ValidationError as exc:
                failures.append(self.record_failure(shard, "bad_response", f"unexpected body: {exc.error_count()} error(s)"))
        if client_errors:
            # Every partition validates the same request the same way: pass the first on.
            raise client_errors[0]
        return answers, failures


def json_or_text(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return {"error": "shard_error", "message": response.text[:500]}


def shard_message(response: httpx.Response) -> str:
    body = json_or_text(response)
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return response.reason_phrase or f"HTTP {response.status_code}"
