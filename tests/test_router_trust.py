"""The router trusts nothing a partition sends (issue 44, parts 1 and 7): `espn route` as a real
process in front of two fake partitions (tests/fakes/partition.py: real HTTP servers on
loopback), one of which answers in every bad way a partition or a proxy in front of it can.

What must hold: the router never answers 500 for anything a partition sends; a write is
acknowledged (2xx) only when its partition's answer is the write result of the ids sent,
anything else a 502 or 503 naming the partition; a batch is 200 only when every part was
applied; a search answer of the wrong shape, with a non-finite score or past the byte limit
is that partition failing (partial, named, counted); and an answer of a gigabyte costs the
router at most the byte limit in memory.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

from benchmarks.common import rss_pss
from espn.partitioning import HASH_NAME, owner
from espn_server.router.answers import MAX_ANSWER_BYTES, MAX_SMALL_ANSWER_BYTES
from fakes.partition import BAD_MODES, FakePartition
from server_fixtures import BIN, HTTP, ServerProcess, free_port

# The failure a search records for each bad mode (anything else: bad_response).
SEARCH_ERROR = {"accepted": "http_202", "status_500": "http_500", "huge": "too_large", "huge_declared": "too_large"}


def _ids(partition: int, n: int, prefix: str = "doc") -> list[str]:
    return [i for i in (f"{prefix}-{j}" for j in range(40 * n)) if owner(i, 2) == partition][:n]


@contextlib.contextmanager
def _router(partitions: list[FakePartition], log_dir: Path, name: str) -> Iterator[ServerProcess]:
    urls = ",".join(p.url for p in partitions)
    port = free_port()
    command = [str(BIN / "espn"), "route", "--shards", urls, "--writers", urls, "--host", "127.0.0.1",
               "--port", str(port), "--timeout-ms", "20000", "--write-timeout-ms", "20000", "--log-level", "warning"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("ESPN_")}
    server = ServerProcess(command, port, log_dir / f"{name}.log", env)
    try:
        server.wait_ready(timeout=120)
        yield server
    finally:
        server.terminate()


@pytest.fixture(scope="module")
def partitions() -> Iterator[list[FakePartition]]:
    parts = [FakePartition(0, 2, {"a0": 0.9, "a1": 0.5}), FakePartition(1, 2, {"b0": 0.8, "b1": 0.3})]
    yield parts
    for part in parts:
        part.close()


@pytest.fixture(scope="module")
def router(partitions: list[FakePartition], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _router(partitions, tmp_path_factory.mktemp("router-trust"), "route") as server:
        yield server.base_url


@pytest.fixture(autouse=True)
def good_partitions(partitions: list[FakePartition]) -> Iterator[None]:
    for part in partitions:
        part.reset()
    yield
    for part in partitions:
        part.reset()


def _finite_scores(answer: dict[str, Any]) -> bool:
    return all(isinstance(h["score"], float) and math.isfinite(h["score"]) for h in answer["results"])


def test_good_partitions_are_relayed(router: str, partitions: list[FakePartition]) -> None:
    (a,), (b,) = _ids(0, 1, "good"), _ids(1, 1, "good")
    search = HTTP.post(f"{router}/v1/search", json={"query": "q", "k": 3})
    assert search.status_code == 200 and search.json()["partial"] is False
    assert [h["id"] for h in search.json()["results"]] == ["a0", "b0", "a1"]
    created = HTTP.put(f"{router}/v1/documents/{a}", json={"text": "one"})
    assert created.status_code == 201 and created.json()["created"] == [a], created.text
    assert created.headers["x-espn-partition"] == "0"
    assert HTTP.put(f"{router}/v1/documents/{a}", json={"text": "one again"}).status_code == 200
    batch = HTTP.post(f"{router}/v1/documents/batch", json={"upsert": [{"id": b, "text": "two"}]})
    assert batch.status_code == 200 and batch.json()["applied"] == [1] and batch.json()["created"] == [b]
    assert HTTP.get(f"{router}/v1/documents/{b}").json()["text"] == "two"
    assert HTTP.delete(f"{router}/v1/documents/{b}").json()["deleted"] == [b]
    # The server's code for the server's case: no partition holds the id.
    missing = HTTP.get(f"{router}/v1/documents/{b}")
    assert missing.status_code == 404 and missing.json()["error"] == "document_not_found"
    # The writer's own refusal is passed on, with the partition named.
    again = HTTP.delete(f"{router}/v1/documents/{b}")
    assert again.status_code == 404 and again.json()["error"] == "document_not_found"
    assert again.json()["partition"] == 1


@pytest.mark.parametrize("mode", BAD_MODES)
def test_a_bad_partition_is_never_relayed_as_success(router: str, partitions: list[FakePartition], mode: str) -> None:
    good, bad = partitions
    (a,), (b,) = _ids(0, 1, mode), _ids(1, 1, mode)
    bad.mode = mode
    applied_before = list(bad.applied)

    # Searches: the bad partition is left out, named and the answer flagged partial.
    expected = SEARCH_ERROR.get(mode, "bad_response")
    search = HTTP.post(f"{router}/v1/search", json={"query": "q", "k": 3}, timeout=60)
    assert search.status_code == 200, search.text
    body = search.json()
    assert body["partial"] is True and [f["shard"] for f in body["failed_shards"]] == [bad.url]
    assert body["failed_shards"][0]["error"] == expected, body["failed_shards"]
    assert [h["id"] for h in body["results"]] == ["a0", "a1"] and _finite_scores(body)
    if expected == "too_large":
        assert str(MAX_ANSWER_BYTES) in body["failed_shards"][0]["message"]
    batch = HTTP.post(f"{router}/v1/search/batch", json={"queries": ["q", "r"], "k": 2}, timeout=60)
    assert batch.status_code == 200, batch.text
    assert batch.json()["partial"] is True and [f["shard"] for f in batch.json()["failed_shards"]] == [bad.url]
    assert all(r["partial"] and _finite_scores(r) for r in batch.json()["responses"])

    # A read of an id the bad partition owns: unavailable, naming it (not found would be a guess).
    read = HTTP.get(f"{router}/v1/documents/{b}", timeout=60)
    assert read.status_code == 503 and read.json()["failed_shards"][0]["shard"] == bad.url, read.text

    # Writes: never acknowledged, a 502 naming the partition.
    for method in ("PUT", "DELETE"):
        write = HTTP.request(method, f"{router}/v1/documents/{b}", json={"text": "x"} if method == "PUT" else None,
                             timeout=60)
        assert write.status_code == 502, (method, write.status_code, write.text)
        refusal = write.json()
        assert refusal["error"] == "bad_gateway" and refusal["partition"] == 1 and bad.url in refusal["message"]
        assert "generation" not in refusal and write.headers["x-espn-partition"] == "1"
        if mode in ("huge", "huge_declared"):
            assert str(MAX_SMALL_ANSWER_BYTES) in refusal["message"]

    # A batch with one part answered badly (with 200 for most modes): not a 2xx, the good
    # part applied and reported, the bad one failed and its ids listed for a retry.
    mixed = HTTP.post(f"{router}/v1/documents/batch", json={"upsert": [{"id": a, "text": "x"}, {"id": b, "text": "y"}]},
                      timeout=60)
    assert mixed.status_code == 502, mixed.text
    outcome = mixed.json()
    assert outcome["applied"] == [0] and outcome["failed"] == [1] and outcome["created"] + outcome["replaced"] == [a]
    failed = outcome["partitions"][1]
    assert failed["status"] == 502 and failed["applied"] is False and failed["generation"] is None
    assert failed["upserts"] == [b] and failed["error"] == "bad_gateway" and bad.url in failed["message"]
    assert ("upsert", a) in good.applied and bad.applied == applied_before

    # Readiness never fails on what a partition's body says.
    assert HTTP.get(f"{router}/readyz", timeout=60).status_code == 200


def test_failures_are_counted_per_partition(router: str, partitions: list[FakePartition]) -> None:
    partitions[1].mode = "nan"
    HTTP.post(f"{router}/v1/search", json={"query": "q"})
    metrics = HTTP.get(f"{router}/metrics").text
    line = f'espn_router_shard_failures_total{{error="bad_response",shard="{partitions[1].url}"}}'
    assert line in metrics and 'espn_router_partial_responses_total{endpoint="search"}' in metrics


def test_a_404_that_is_not_document_not_found_is_a_failure(router: str, partitions: list[FakePartition]) -> None:
    """A wrong URL prefix (or a proxy's 404 page) is not the document missing."""
    (b,) = _ids(1, 1, "path")
    partitions[1].mode = "path_404"
    read = HTTP.get(f"{router}/v1/documents/{b}")
    assert read.status_code == 503 and read.json()["failed_shards"][0]["error"] == "http_404", read.text
    # To a write, a 404 is the writer's refusal: passed on (not acknowledged), the partition named.
    write = HTTP.put(f"{router}/v1/documents/{b}", json={"text": "x"})
    assert write.status_code == 404 and write.json()["error"] == "writer_error" and write.json()["partition"] == 1


# A writer's /readyz answers of every shape, with what a write to it gets.
READYZ_CASES = [
    (b"[1, 2]", 502, "bad_gateway"),
    (b"<html>ready</html>", 502, "bad_gateway"),
    (b'{"status": "ready", "partition": [1, 2]}', 502, "bad_gateway"),
    (b'{"status": "ready", "partition": {"index": "1", "count": 2, "by": "x"}}', 502, "bad_gateway"),
    (b'{"status": "ready", "partition": {"index": 1, "count": 2, "by": NaN}}', 502, "bad_gateway"),
    (b'{"status": "ready", "partition": {"index": 1, "count": 2, "by": "%s"}' % HASH_NAME.encode(), 502,
     "bad_gateway"),  # cut off
    (b"[" * 10_000 + b"]" * 10_000, 502, "bad_gateway"),
    (b'{"status": "ready"}', 503, "layout_mismatch"),
    (b'{"status": "ready", "partition": {"index": 0, "count": 2, "by": "%s"}}' % HASH_NAME.encode(), 503,
     "layout_mismatch"),
]


def test_a_writer_readyz_of_any_shape_gets_no_write_and_no_500(partitions: list[FakePartition],
                                                               tmp_path: Path) -> None:
    """A router of its own: it reads a writer's /readyz before its first write to it, and again
    after every refusal (a refusal is not remembered as verified)."""
    bad = partitions[1]
    (b,) = _ids(1, 1, "ready")
    with _router(partitions, tmp_path, "route") as server:
        for readyz, status, error in READYZ_CASES:
            bad.readyz = readyz
            assert HTTP.get(f"{server.base_url}/readyz").status_code == 200  # the router's: status only
            sent = len(bad.requests)
            refused = HTTP.put(f"{server.base_url}/v1/documents/{b}", json={"text": "x"})
            assert refused.status_code == status and refused.json()["error"] == error, (readyz[:80], refused.text)
            assert refused.json()["partition"] == 1 and bad.url in refused.json()["message"]
            assert [r for r in bad.requests[sent:] if r[0] == "PUT"] == [], readyz[:80]  # no write was sent
        bad.readyz = None  # fixed: the next write checks it again and goes through
        assert HTTP.put(f"{server.base_url}/v1/documents/{b}", json={"text": "x"}).status_code in (200, 201)


def test_an_oversized_answer_costs_the_router_at_most_the_limit(
        partitions: list[FakePartition], tmp_path: Path, record_property: Any) -> None:
    """A partition streaming 1 GiB: the router stops reading past MAX_ANSWER_BYTES and its peak
    memory grows by about that much, not by the gigabyte."""
    with _router(partitions, tmp_path, "route") as server:
        for _ in range(20):  # the code paths warm, so that what grows after is the answer
            assert HTTP.post(f"{server.base_url}/v1/search", json={"query": "q"}).status_code == 200
        before = rss_pss(server.pid)["peak_rss"] / (1 << 20)
        partitions[1].mode = "huge"
        answer = HTTP.post(f"{server.base_url}/v1/search", json={"query": "q"}, timeout=120)
        after = rss_pss(server.pid)["peak_rss"] / (1 << 20)
        assert answer.status_code == 200 and answer.json()["failed_shards"][0]["error"] == "too_large"
        partitions[1].mode = "good"
        assert HTTP.post(f"{server.base_url}/v1/search", json={"query": "q"}).json()["partial"] is False
    grown_mib = after - before
    streamed_mib = partitions[1].streamed / (1 << 20)
    record_property("router_peak_before_mib", before)
    record_property("router_peak_after_mib", after)
    print(f"router peak RSS {before:.0f} -> {after:.0f} MiB "
          f"(+{grown_mib:.0f}); the partition got {streamed_mib:.0f} MiB of its 1024 out")
    limit_mib = MAX_ANSWER_BYTES / (1 << 20)
    # The read stopped near the limit (socket buffers hold a few MiB more) ...
    assert streamed_mib < 2 * limit_mib
    # ... and the router held about the limit: chunks in a list, nothing joined or parsed.
    assert grown_mib < 2 * limit_mib + 32
