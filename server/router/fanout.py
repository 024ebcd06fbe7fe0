"""Calling the partitions: one request to every partition at once, each bounded in time and in
bytes, each answer checked (`.answers`); a replica that fails is replaced by the partition's
next one (`.routing.Target`), and what failed on every replica is counted and named, never
raised (a missing partition makes an answer partial)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Callable, Optional, TypeVar

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from .answers import MAX_ANSWER_BYTES, AnswerTooLarge, BadAnswer, PartitionAnswer, error_body, fetch
from .index_path import shard_path
from .models import ShardFailure
from .routing import Target

__all__ = ["CALLER_ERRORS", "ClientError", "Fanout", "RouterMetrics", "shard_message"]

T = TypeVar("T")

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
    """The client that calls the partitions, how long each call may take, and where they are
    (`targets()`: the routing's partitions, each with its replicas)."""

    client: httpx.AsyncClient
    targets: Callable[[], list[Target]]
    timeout_s: float
    metrics: RouterMetrics

    @property
    def shards(self) -> list[str]:
        """Each partition's name (its URL, or its replicas joined by |), in partition order."""
        return [target.name for target in self.targets()]

    async def call(self, shard: str, method: str, path: str, headers: dict[str, str],
                   json_body: Optional[dict[str, Any]], max_bytes: int = MAX_ANSWER_BYTES
                   ) -> PartitionAnswer | ShardFailure:
        """The shard's answer, read whole up to `max_bytes`, or the failure (recorded)."""
        try:
            # wait_for bounds the whole exchange (connect, queueing for a pooled connection,
            # response), which httpx's per-phase timeouts alone do not.
            return await asyncio.wait_for(
                fetch(self.client, method, shard + shard_path(path), headers=headers, json=json_body,
                      max_bytes=max_bytes),
                self.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            return self.record_failure(shard, "timeout", f"no answer within {self.timeout_s * 1000:.0f} ms")
        except httpx.TransportError as exc:
            return self.record_failure(shard, "unreachable", f"{type(exc).__name__}: {exc}")
        except AnswerTooLarge as exc:
            return self.record_failure(shard, "too_large", str(exc))
        except httpx.DecodingError as exc:  # a Content-Encoding its body does not follow
            return self.record_failure(shard, "bad_response", f"the answer does not decode: {exc}")

    def record_failure(self, shard: str, error: str, message: str) -> ShardFailure:
        self.metrics.shard_failures.labels(shard=shard, error=error).inc()
        logger.warning("shard %s failed: %s (%s)", shard, error, message)
        return ShardFailure(shard=shard, error=error, message=message)

    async def search(self, path: str, body: dict[str, Any], headers: dict[str, str],
                     check: Callable[[PartitionAnswer, dict[str, Any]], T]
                     ) -> tuple[list[tuple[Target, T]], list[ShardFailure]]:
        """POST `body` to every partition at once; returns (each answering partition with its
        answer that passed `check`, failures). A replica that fails (no answer in time, a 5xx,
        an answer `check` refuses: the wrong shape, a non-finite score, more hits than asked)
        is replaced by the partition's next replica; the partition fails when all have."""
        targets = self.targets()
        outcomes = await asyncio.gather(*(self.ask(target, path, body, headers, check) for target in targets))
        answers: list[tuple[Target, T]] = []
        failures: list[ShardFailure] = []
        client_errors: list[ClientError] = []
        for target, outcome in zip(targets, outcomes):
            if isinstance(outcome, ShardFailure):
                failures.append(outcome)
            elif isinstance(outcome, ClientError):
                client_errors.append(outcome)
            else:
                answers.append((target, outcome))
        if client_errors:
            # Every partition validates the same request the same way: pass the first on.
            raise client_errors[0]
        return answers, failures

    async def ask(self, target: Target, path: str, body: dict[str, Any], headers: dict[str, str],
                  check: Callable[[PartitionAnswer, dict[str, Any]], T]) -> T | ShardFailure | ClientError:
        """One partition's answer, from its replicas in turn: the first that checks, a caller
        error (the request's own fault: no other replica would take it), or the last failure."""
        failure: ShardFailure | None = None
        for replica in target.order():
            outcome = await self.call(replica, "POST", path, headers, body)
            if isinstance(outcome, ShardFailure):
                target.failed(replica)
                failure = outcome
                continue
            status = outcome.status
            # A 404 for a named index (/v1/indexes/{name}/...): the partitions do not hold that index.
            if status in CALLER_ERRORS or (status == 404 and shard_path(path) != path):
                return ClientError(status, error_body(outcome, "shard_error"))
            if status != 200:
                target.failed(replica)
                failure = self.record_failure(replica, f"http_{status}", shard_message(outcome))
                continue
            try:
                return check(outcome, body)
            except BadAnswer as exc:
                target.failed(replica)
                failure = self.record_failure(replica, "bad_response", str(exc))
        return failure or self.no_replica(target)

    def no_replica(self, target: Target) -> ShardFailure:
        """A partition with no replica to ask (none registered in the shard map)."""
        return self.record_failure(target.name, "unreachable", f"partition {target.partition} has no replica")


def shard_message(answer: PartitionAnswer) -> str:
    """What a failed shard said, in one bounded line."""
    return str(error_body(answer, "shard_error")["message"])[:500]
