"""Writes through the router: placement by the id's hash, the layout check, atomic parts per
partition, and the answers for a writer that is down, slow or misconfigured. The writers
here are fakes behind an httpx mock transport that answer as `espn serve` does (each
refuses an id it does not own, as the real one does: tests/test_replication.py runs the
real processes end to end)."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable
from urllib.parse import quote, unquote

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from espn.partitioning import HASH_NAME, PartitionLayout, WrongPartitionError, id_hashes, owner, owners
from espn_server.router import RouterSettings, build_router_app

SHARDS = ["http://part-0:8000", "http://part-1:8000"]
WRITERS = ["http://writer-0:8000", "http://writer-1:8000"]


def _ids_of(partition: int, n: int) -> list[str]:
    found = [f"doc-{i}" for i in range(10 * n) if owner(f"doc-{i}", 2) == partition]
    return found[:n]


class FakeWriter:
    """A partition's writer: reports its layout, applies what it owns, refuses the rest (421)."""

    def __init__(self, index: int, count: int = 2, by: str | None = HASH_NAME, status: int = 200,
                 delay_s: float = 0.0) -> None:
        self.layout = {"index": index, "count": count, "by": by}
        self.status, self.delay_s = status, delay_s
        self.docs: dict[str, Any] = {}
        self.generation = 0
        self.requests: list[httpx.Request] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path == "/readyz":
            return httpx.Response(200, json={"status": "ready", "partition": self.layout})
        if self.delay_s:
            await asyncio.sleep(self.delay_s)  # a slow writer, simulated: not synchronisation
        if self.status != 200:
            return httpx.Response(self.status, json={"error": "x", "message": "boom"}, headers={"Retry-After": "7"})
        if request.url.path == "/v1/documents/batch":
            body = json.loads(request.content)
            ids = [d["id"] for d in body.get("upsert", [])] + body.get("delete", [])
        else:
            ids = [unquote(request.url.raw_path.decode().split("/v1/documents/", 1)[1])]
        layout = PartitionLayout(**self.layout)
        try:
            layout.check_owned(ids)
        except WrongPartitionError as exc:
            return httpx.Response(421, json={"error": "wrong_partition", "message": str(exc)})
        if request.method == "GET":
            found = ids[0] in self.docs
            return httpx.Response(200 if found else 404, json={"id": ids[0]} if found else {"error": "not_found",
                                                                                             "message": "no"})
        missing = [i for i in (json.loads(request.content).get("delete", []) if request.method == "POST" else
                               ids if request.method == "DELETE" else []) if i not in self.docs]
        if missing:
            return httpx.Response(404, json={"error": "document_not_found", "message": f"{missing[0]} unknown"})
        self.generation += 1
        created, replaced, deleted = [], [], []
        if request.method == "PUT":
            (replaced if ids[0] in self.docs else created).append(ids[0])
            self.docs[ids[0]] = json.loads(request.content)
        elif request.method == "DELETE":
            deleted.append(self.docs.pop(ids[0]) and ids[0])
        else:
            for doc in body.get("upsert", []):
                (replaced if doc["id"] in self.docs else created).append(doc["id"])
                self.docs[doc["id"]] = doc
            for doc_id in body.get("delete", []):
                del self.docs[doc_id]
                deleted.append(doc_id)
        return httpx.Response(201 if created and request.method == "PUT" else 200,
                              json={"generation": self.generation, "created": created, "replaced": replaced,
                                    "deleted": deleted})


def _router(backends: dict[str, Callable[..., Any]], writers: list[str] = WRITERS,
            write_timeout_ms: float = 2000.0) -> TestClient:
    async def route(request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if base not in backends:
            raise httpx.ConnectError("connection refused", request=request)
        return await backends[base](request)

    settings = RouterSettings(shards=SHARDS, writers=writers, write_timeout_ms=write_timeout_ms)
    return TestClient(build_router_app(settings, transport=httpx.MockTransport(route)))


def test_the_hash_is_fnv1a_64_of_the_utf8_id() -> None:
    def reference(data: bytes) -> int:
        h = 0xCBF29CE484222325
        for byte in data:
            h = ((h ^ byte) * 0x100000001B3) % (1 << 64)
        return h

    ids = ["a", "doc-1", "ünïcødé/ключ", "x" * 300, "12345"]
    got = id_hashes(np.array([i.encode() for i in ids], dtype=bytes))
    assert [int(h) for h in got] == [reference(i.encode()) for i in ids]
    assert [owner(i, 7) for i in ids] == owners(np.array([i.encode() for i in ids], dtype=bytes), 7).tolist()
    # Balanced enough that partitions are of a size: 10,000 ids over 4 partitions.
    counts = np.bincount(owners(np.array([f"id{i}".encode() for i in range(10_000)], dtype=bytes), 4))
    assert counts.min() > 2300 and counts.max() < 2700


def test_put_and_delete_go_to_the_owner_and_get_to_its_followers() -> None:
    w0, w1 = FakeWriter(0), FakeWriter(1)
    followers_asked: list[str] = []

    async def follower(request: httpx.Request) -> httpx.Response:
        followers_asked.append(str(request.url))
        return httpx.Response(200, json={"id": "x", "title": "", "text": "t"})

    (a,), (b,) = _ids_of(0, 1), _ids_of(1, 1)
    with _router({WRITERS[0]: w0, WRITERS[1]: w1, SHARDS[0]: follower, SHARDS[1]: follower}) as client:
        created = client.put(f"/v1/documents/{a}", json={"text": "one"})
        assert created.status_code == 201 and created.headers["x-espn-partition"] == "0"
        assert client.put(f"/v1/documents/{b}", json={"text": "two"}).headers["x-espn-partition"] == "1"
        assert client.put(f"/v1/documents/{b}", json={"text": "two again"}).status_code == 200  # replaced
        assert set(w0.docs) == {a} and set(w1.docs) == {b}
        assert client.delete(f"/v1/documents/{a}").json()["deleted"] == [a]
        assert client.delete(f"/v1/documents/{a}").status_code == 404  # the writer's answer, passed on
        client.get(f"/v1/documents/{b}")
        assert followers_asked == [f"{SHARDS[1]}/v1/documents/{b}"]  # the owner's followers only
        # Ids that need escaping reach the owner byte for byte.
        odd = next(i for i in (f"dir/ü {n}?" for n in range(50)) if owner(i, 2) == 1)
        assert client.put("/v1/documents/" + quote(odd, safe=""), json={"text": "odd"}).status_code == 201
        assert odd in w1.docs
        assert client.put("/v1/documents/bad%FFid", json={"text": "x"}).status_code == 422


def test_a_batch_is_split_by_owner_and_says_which_partitions_applied() -> None:
    w0, w1 = FakeWriter(0), FakeWriter(1)
    zero, one = _ids_of(0, 3), _ids_of(1, 3)
    with _router({WRITERS[0]: w0, WRITERS[1]: w1}) as client:
        body = {"upsert": [{"id": i, "text": f"text of {i}"} for i in zero + one]}
        answer = client.post("/v1/documents/batch", json=body)
        assert answer.status_code == 200, answer.text
        result = answer.json()
        assert sorted(result["created"]) == sorted(zero + one) and result["applied"] == [0, 1]
        assert set(w0.docs) == set(zero) and set(w1.docs) == set(one)
        assert [len(w.requests) for w in (w0, w1)] == [2, 2]  # /readyz once, then one atomic part each

        # A part refused on one partition (an unknown id to delete) leaves the other's applied: the
        # answer names both, with the ids of the failed part, and carries the failure's status.
        unknown = next(i for i in _ids_of(1, 20) if i not in one)
        mixed = client.post("/v1/documents/batch", json={"delete": [zero[0], unknown]})
        outcome = mixed.json()
        assert mixed.status_code == 404 and outcome["applied"] == [0] and outcome["failed"] == [1]
        failed = outcome["partitions"][1]
        assert failed["error"] == "document_not_found" and failed["deletes"] and not failed["applied"]
        assert zero[0] not in w0.docs

        assert client.post("/v1/documents/batch", json={"upsert": []}).status_code == 422
        assert client.post("/v1/documents/batch", content=b"{not json").status_code == 422
        assert client.get("/v1/documents/batch").status_code == 405
        assert client.get("/v1/documents/batch").headers["allow"] == "POST"
        moved = client.post("/v1/documents/a")
        assert moved.status_code == 405 and moved.headers["allow"] == "GET, PUT, DELETE"


def test_a_writer_down_is_503_with_retry_after_and_the_other_partition_goes_on() -> None:
    w1 = FakeWriter(1)
    zero, one = _ids_of(0, 1), _ids_of(1, 1)
    with _router({WRITERS[1]: w1}) as client:  # writer-0 refuses connections
        down = client.put(f"/v1/documents/{zero[0]}", json={"text": "x"})
        assert down.status_code == 503 and down.headers["retry-after"] == "2"
        assert down.json()["error"] == "writer_unavailable" and down.json()["partition"] == 0
        assert client.put(f"/v1/documents/{one[0]}", json={"text": "y"}).status_code == 201
        both = client.post("/v1/documents/batch", json={"upsert": [{"id": zero[0], "text": "x"},
                                                                   {"id": one[0], "text": "y"}]})
        assert both.status_code == 503 and both.headers["retry-after"] == "2"
        assert both.json()["applied"] == [1] and both.json()["failed"] == [0]
        metrics = client.get("/metrics").text
        assert 'espn_router_shard_failures_total{error="writer_unavailable",shard="http://writer-0:8000"}' in metrics


def test_a_slow_writer_is_a_504_that_says_the_write_may_have_applied() -> None:
    with _router({WRITERS[0]: FakeWriter(0, delay_s=2), WRITERS[1]: FakeWriter(1)}, write_timeout_ms=200) as client:
        slow = client.put(f"/v1/documents/{_ids_of(0, 1)[0]}", json={"text": "x"})
        assert slow.status_code == 504 and "may or may not" in slow.json()["message"]


@pytest.mark.parametrize("writer, expected", [
    (FakeWriter(1), "reports partition 1 of 2"),                       # writers listed in the wrong order
    (FakeWriter(0, count=3), "partition 0 of 3"),                      # another layout
    (FakeWriter(0, by=None), "by None"),                               # built before the hash rule
])
def test_a_writer_with_another_layout_gets_no_write(writer: FakeWriter, expected: str) -> None:
    with _router({WRITERS[0]: writer, WRITERS[1]: FakeWriter(1)}) as client:
        refused = client.put(f"/v1/documents/{_ids_of(0, 1)[0]}", json={"text": "x"})
        assert refused.status_code == 503 and refused.json()["error"] == "layout_mismatch"
        assert expected in refused.json()["message"] and "retry-after" not in refused.headers
        assert writer.docs == {} and [r.url.path for r in writer.requests] == ["/readyz"]


def test_router_without_writers_refuses_writes_with_405_naming_the_flag() -> None:
    settings = RouterSettings(shards=SHARDS)
    with TestClient(build_router_app(settings, transport=httpx.MockTransport(lambda r: httpx.Response(500)))) as c:
        refused = c.put("/v1/documents/a", json={"text": "x"})
        assert refused.status_code == 405 and "--writers" in refused.json()["message"]
        assert refused.headers["allow"] == "GET" and "takes GET" in refused.json()["message"]
        # Starlette's own 405s get the error body and an Allow naming every method of the path.
        for method, path, allowed in [("GET", "/v1/search", "POST"), ("PUT", "/v1/search/batch", "POST"),
                                      ("POST", "/healthz", "GET")]:
            wrong = c.request(method, path)
            assert wrong.status_code == 405 and wrong.headers["allow"] == allowed, (method, path)
            assert wrong.json()["error"] == "method_not_allowed" and allowed in wrong.json()["message"]


def test_writers_must_match_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="one writer per partition"):
        RouterSettings(shards=SHARDS, writers=WRITERS[:1])
    monkeypatch.setenv("ESPN_ROUTER_WRITERS", ",".join(WRITERS))
    assert RouterSettings(shards=SHARDS).writers == WRITERS
    with pytest.raises(ValidationError, match="writer URL must be"):
        RouterSettings(shards=SHARDS, writers=["ftp://a", "http://b"])
