"""The router: merging, partial answers, error paths (fake shards behind an httpx mock
transport), then end to end: two real `espn serve` processes on loopback, one per
partition of a SciFact slice, give through the router the ranking one index of the whole
slice gives; with one of them killed, the router answers from the other and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import unquote

import httpx
import pytest
from fastapi.testclient import TestClient

from espn_server.commands import run_route
from espn_server.router import RouterSettings, build_router_app, fuse_hits, merge_hits
from espn_server.schemas import SearchHit
from helpers import wait_until, write_scifact_subset
from server_fixtures import HTTP

ROOT = Path(__file__).resolve().parents[1]
SCIFACT = Path(os.environ.get("ESPN_SCIFACT", ROOT.parent / "shared" / "data" / "scifact"))

A, B = "http://shard-a:8000", "http://shard-b:8000"


# ---------------------------------------------------------------------------------------
# Fake shards: each holds documents with fixed scores and answers like `espn serve`.


def _hit(doc_id: str, score: float) -> dict[str, Any]:
    return {"id": doc_id, "score": score, "cls_score": score, "bow_score": score, "title": None, "text": None}


def _stats(**overrides: Any) -> dict[str, Any]:
    stats = {"stage_ms": {"ann": 1.0, "total": 2.0}, "queue_ms": 0.5, "batch_size": 1, "hit_rate": 1.0,
             "bytes_read": 4096, "ios": 1, "prefetched": 3, "missed": 0}
    return stats | overrides


class FakeShard:
    """Scores depend on the query text so different queries rank differently."""

    def __init__(self, docs: dict[str, float], delay_s: float = 0.0, status: int = 200,
                 body: Any = None, ready: bool = True) -> None:
        self.docs, self.delay_s, self.status, self.body, self.ready = docs, delay_s, status, body, ready
        self.requests: list[httpx.Request] = []
        self.answered = 0  # requests this shard finished answering (a slow one may be abandoned first)

    def ranking(self, query: str, k: int) -> list[dict[str, Any]]:
        scored = sorted(((score + 0.01 * len(query) * (i % 3), doc_id) for i, (doc_id, score) in
                         enumerate(sorted(self.docs.items()))), reverse=True)
        return [_hit(doc_id, score) for score, doc_id in scored[:k]]

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)  # a slow partition, simulated: not synchronisation
        self.answered += 1
        if request.url.path == "/readyz":
            return httpx.Response(200 if self.ready else 503, json={"status": "ready" if self.ready else "starting"})
        if self.status != 200 or self.body is not None:
            return httpx.Response(self.status, json=self.body if self.body is not None else {"error": "x", "message": "boom"})
        if request.url.path.startswith("/v1/documents/"):
            doc_id = unquote(request.url.raw_path.decode().rsplit("/", 1)[1])
            if doc_id in self.docs:
                return httpx.Response(200, json={"id": doc_id, "title": "t", "text": "x"})
            return httpx.Response(404, json={"error": "document_not_found", "message": "no"})  # as the server
        body = json.loads(request.content)
        if request.url.path == "/v1/search":
            return httpx.Response(200, json={"query": body["query"], "results": self.ranking(body["query"], body["k"]),
                                             "stats": _stats()})
        responses = [{"query": q, "results": self.ranking(q, body["k"]), "stats": _stats()} for q in body["queries"]]
        return httpx.Response(200, json={"responses": responses})


def _router(shards: dict[str, Callable[..., Any]], timeout_ms: float = 500.0) -> TestClient:
    async def route(request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        handler = shards[base]
        return await handler(request)

    settings = RouterSettings(shards=list(shards), timeout_ms=timeout_ms)
    return TestClient(build_router_app(settings, transport=httpx.MockTransport(route)))


def _brute_force(shards: list[FakeShard], query: str, k: int) -> list[tuple[str, float]]:
    union = [(h["id"], h["score"]) for s in shards for h in s.ranking(query, len(s.docs))]
    return sorted(union, key=lambda item: -item[1])[:k]


def test_merge_equals_top_k_of_the_union() -> None:
    a = FakeShard({f"a{i}": 1.0 - i / 10 for i in range(8)})
    b = FakeShard({f"b{i}": 0.95 - i / 7 for i in range(8)})
    with _router({A: a, B: b}) as client:
        for query, k in (("q", 5), ("a longer query", 10), ("x", 16), ("y", 1)):
            response = client.post("/v1/search", json={"query": query, "k": k})
            assert response.status_code == 200, response.text
            body = response.json()
            assert [(h["id"], h["score"]) for h in body["results"]] == _brute_force([a, b], query, k)
            assert body["partial"] is False and body["failed_shards"] == []
            assert body["stats"]["shards_answered"] == 2 and body["stats"]["bytes_read"] == 2 * 4096
    # Every shard got the same request, the router's k and options passed on unchanged.
    sent = [json.loads(r.content) for r in a.requests]
    assert sent[0] == {"query": "q", "k": 5, "return_text": False}


def test_batch_merges_each_query() -> None:
    a = FakeShard({f"a{i}": 1.0 - i / 10 for i in range(6)})
    b = FakeShard({f"b{i}": 0.97 - i / 9 for i in range(6)})
    with _router({A: a, B: b}) as client:
        queries = ["one", "query two", "three three three"]
        response = client.post("/v1/search/batch", json={"queries": queries, "k": 4, "nprobe": 2})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["partial"] is False and [r["query"] for r in body["responses"]] == queries
        for query, answer in zip(queries, body["responses"]):
            assert [(h["id"], h["score"]) for h in answer["results"]] == _brute_force([a, b], query, 4)
    assert json.loads(b.requests[0].content)["nprobe"] == 2


def test_slow_shard_gives_a_partial_answer_within_the_timeout() -> None:
    a = FakeShard({"a0": 0.5, "a1": 0.4})
    # A shard that would take 5 minutes: had the router waited for it, it would have answered
    # (slow.answered == 1) before the router did; no clock is read here.
    slow = FakeShard({"b0": 0.9}, delay_s=300.0)
    with _router({A: a, B: slow}, timeout_ms=200) as client:
        response = client.post("/v1/search", json={"query": "q", "k": 3})
        assert len(slow.requests) == 1 and slow.answered == 0
        body = response.json()
        assert response.status_code == 200 and body["partial"] is True
        assert body["failed_shards"] == [{"shard": B, "error": "timeout", "message": "no answer within 200 ms"}]
        assert [h["id"] for h in body["results"]] == ["a0", "a1"]
        assert body["stats"]["shards_answered"] == 1 and body["stats"]["shards_total"] == 2
        batch = client.post("/v1/search/batch", json={"queries": ["q", "r"], "k": 3}).json()
        assert batch["partial"] is True and all(r["partial"] for r in batch["responses"])
        metrics = client.get("/metrics").text
        assert 'espn_router_partial_responses_total{endpoint="search"} 1.0' in metrics
        assert 'espn_router_shard_failures_total{error="timeout",shard="http://shard-b:8000"} 2.0' in metrics


@pytest.mark.parametrize(
    "broken, error",
    [
        (lambda request: (_ for _ in ()).throw(httpx.ConnectError("refused", request=request)), "unreachable"),
        (FakeShard({}, status=503, body={"error": "unavailable", "message": "warming"}), "http_503"),
        (FakeShard({}, status=500, body={"oops": True}), "http_500"),
        (FakeShard({}, status=404, body={"detail": "Not Found"}), "http_404"),  # wrong URL prefix
        (FakeShard({}, status=200, body={"not": "a search response"}), "bad_response"),
    ],
    ids=["refused", "503", "500", "404", "garbled"],
)
def test_failed_shard_gives_a_partial_answer(broken: Any, error: str) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        result = broken(request)
        return await result if asyncio.iscoroutine(result) else result

    with _router({A: FakeShard({"a0": 0.5}), B: handler}) as client:
        body = client.post("/v1/search", json={"query": "q", "k": 3}).json()
        assert body["partial"] is True and [h["id"] for h in body["results"]] == ["a0"]
        assert body["failed_shards"][0]["shard"] == B and body["failed_shards"][0]["error"] == error


def test_a_partition_whose_replica_fails_is_answered_by_its_other_replica() -> None:
    a2 = "http://shard-a2:8000"
    dead, healthy, other = FakeShard({}, status=503), FakeShard({"a0": 0.5, "a1": 0.4}), FakeShard({"b0": 0.45})
    replicas = {A: dead, a2: healthy, B: other}

    async def route(request: httpx.Request) -> httpx.Response:
        return await replicas[f"{request.url.scheme}://{request.url.host}:{request.url.port}"](request)

    settings = RouterSettings(shards=[f"{A}|{a2}", B], timeout_ms=500)  # partition 0 has two replicas
    with TestClient(build_router_app(settings, transport=httpx.MockTransport(route))) as client:
        for query in ("q", "query two", "three"):
            body = client.post("/v1/search", json={"query": query, "k": 3}).json()
            assert body["partial"] is False and body["stats"]["shards_total"] == 2
            expected = _brute_force([healthy, other], query, 3)
            assert [(h["id"], h["score"]) for h in body["results"]] == expected
        assert client.get("/v1/documents/a1").status_code == 200
    # Failed once, then tried after its sibling for REPLICA_COOLDOWN_S: one wasted call, not one per search.
    assert len(dead.requests) == 1 and len(healthy.requests) == 4


def test_no_shard_answers_is_503() -> None:
    with _router({A: FakeShard({}, status=503, ready=False), B: FakeShard({}, delay_s=5)}, timeout_ms=100) as client:
        response = client.post("/v1/search", json={"query": "q", "k": 3})
        assert response.status_code == 503
        body = response.json()
        assert body["error"] == "no_shard_answered"
        assert sorted(f["error"] for f in body["failed_shards"]) == ["http_503", "timeout"]
        assert client.get("/readyz").status_code == 503
        assert client.get("/healthz").json() == {"status": "ok", "detail": None}


def test_caller_mistakes_are_passed_on_not_hidden_as_partial() -> None:
    shard_says = {"error": "invalid_parameter", "message": "nprobe must be an integer in [1, 4], got 9"}
    with _router({A: FakeShard({}, status=422, body=shard_says), B: FakeShard({"b": 1.0})}) as client:
        response = client.post("/v1/search", json={"query": "q", "k": 3, "nprobe": 9})
        assert response.status_code == 422 and response.json() == shard_says
    a = FakeShard({"a": 1.0})
    with _router({A: a, B: FakeShard({"b": 1.0})}) as client:
        for bad in ({"query": "", "k": 3}, {"query": "q", "k": 0}, {"query": "q", "kk": 1}, {"queries": []}):
            response = client.post("/v1/search", json=bad)
            assert response.status_code == 422 and response.json()["error"] == "invalid_request", bad
        assert client.post("/v1/search/batch", json={"queries": []}).status_code == 422
    assert a.requests == []  # refused at the router, no fan-out


def test_headers_forwarded_and_documents_found_in_any_shard() -> None:
    a, b = FakeShard({"a0": 0.5}), FakeShard({"b/0": 0.9})
    with _router({A: a, B: b}) as client:
        client.post("/v1/search", json={"query": "q"}, headers={"Authorization": "Bearer s3cret", "X-Other": "no"})
        assert a.requests[-1].headers["authorization"] == "Bearer s3cret"
        assert "x-other" not in a.requests[-1].headers
        assert client.get("/v1/documents/a0").json()["id"] == "a0"
        assert client.get("/v1/documents/b%2F0").json()["id"] == "b/0"
        missing = client.get("/v1/documents/nope")
        assert missing.status_code == 404 and missing.json()["error"] == "document_not_found"  # the server's code
    with _router({A: a, B: FakeShard({}, delay_s=5)}, timeout_ms=100) as client:
        assert client.get("/v1/documents/a0").status_code == 200
        assert client.get("/v1/documents/nope").status_code == 503  # may live in the silent shard


def test_ready_while_one_shard_is_ready() -> None:
    with _router({A: FakeShard({}, ready=False), B: FakeShard({})}) as client:
        response = client.get("/readyz")
        assert response.status_code == 200 and response.json()["detail"] == "1 of 2 shard(s) ready"
    with _router({A: FakeShard({}, ready=False), B: FakeShard({}, ready=False)}) as client:
        assert client.get("/readyz").status_code == 503


def test_merge_hits_ties_duplicates_and_short_lists() -> None:
    def hits(*pairs: tuple[str, float]) -> list[SearchHit]:
        return [SearchHit(id=i, score=s, cls_score=s, bow_score=None) for i, s in pairs]

    merged = merge_hits([hits(("a", 0.9), ("b", 0.5)), hits(("c", 0.9), ("a", 0.4), ("d", 0.1))], k=4)
    assert [h.id for h in merged] == ["a", "c", "b", "d"]  # tie: first shard first; duplicate "a" once
    assert merge_hits([hits(), hits(("x", 1.0))], k=10)[0].id == "x"
    assert merge_hits([hits(), hits()], k=3) == []


def test_fuse_hits_equals_fusing_the_whole_pool() -> None:
    """Two partitions' hybrid pools, fused by the router, rank exactly as `fuse` over the pool one
    index would hold (same scores on both sides), for both fusions."""
    import numpy as np

    from espn.params import HybridParams
    from espn.search.hybrid import fuse

    rng = np.random.default_rng(5)
    n = 60
    dense = rng.normal(size=n)
    lexical = np.where(rng.random(n) < 0.6, rng.gamma(2.0, size=n), np.nan)
    hits = [SearchHit(id=f"d{i}", score=0.0, cls_score=0.0, bow_score=0.0, dense_score=float(dense[i]),
                      lexical_score=None if np.isnan(lexical[i]) else float(lexical[i])) for i in range(n)]
    for params in (HybridParams(fusion="rrf", lexical_k=20), HybridParams(fusion="mix", mix_weight=0.3, lexical_k=20)):
        report = {**params.to_json(), "rerank_count": 30}
        routed = fuse_hits([hits[0::2], hits[1::2]], 10, report)
        # One index: the top 30 by dense and the top 20 by BM25, then fused.
        top_dense = set(np.argsort(-dense, kind="stable")[:30].tolist())
        present = np.flatnonzero(~np.isnan(lexical))
        top_lexical = set(present[np.argsort(-lexical[present], kind="stable")[:20]].tolist())
        pool = np.array(sorted(top_dense | top_lexical))
        lexical_pool = np.array([lexical[i] if i in top_lexical else np.nan for i in pool])
        whole = fuse(pool, dense[pool], lexical_pool, params)
        assert [hit.id for hit in routed] == [f"d{i}" for i in whole.doc[:10].tolist()]
        assert [hit.score for hit in routed] == pytest.approx(whole.score[:10].tolist())


def test_settings_validate_shard_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESPN_ROUTER_SHARDS", " http://a:1/ ,http://b:2")
    assert RouterSettings().shards == ["http://a:1", "http://b:2"]
    for bad in ("", "a:1", "ftp://a", "http://a:1,http://a:1/", "http://a:1/?x=1"):
        with pytest.raises(ValueError, match="shard"):
            RouterSettings(shards=bad)
    with pytest.raises(ValueError, match="timeout_ms"):
        RouterSettings(shards="http://a:1", timeout_ms=0)
    monkeypatch.delenv("ESPN_ROUTER_SHARDS")
    args = argparse.Namespace(shards="not-a-url", timeout_ms=None, host=None, port=None, log_level=None)
    assert run_route(args) == 2


# ---------------------------------------------------------------------------------------
# End to end: real `espn serve` processes on loopback

SLICE = 200  # SciFact documents: enough for two partitions, small enough for about a minute
NLIST = 4


def _espn() -> list[str]:
    exe = Path(sys.executable).parent / "espn"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "espn.cli"]


def _run(*args: str) -> None:
    done = subprocess.run([*_espn(), *args], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"espn {' '.join(args)} failed:\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """One SciFact slice, encoded once (two shard jobs, like the Kubernetes Indexed Job),
    then assembled twice from the same chunks: as one whole index and as two partitions."""
    corpus_gz = SCIFACT / "corpus.jsonl.gz"
    if not corpus_gz.is_file():
        pytest.skip(f"SciFact not found at {corpus_gz} (the shared data directory beside the repository)")
    tmp = tmp_path_factory.mktemp("router")
    corpus = write_scifact_subset(SCIFACT, tmp / "corpus.jsonl", SLICE)
    common = ["--nlist", str(NLIST), "--chunk-size", "50", "--no-progress"]
    # Both shard processes at once on one work dir, as the Indexed Job's pods run.
    shards = [subprocess.Popen([*_espn(), "index", str(corpus), "--out", str(tmp / "parts"), "--shard", shard, *common],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for shard in ("0/2", "1/2")]
    for process in shards:
        _, stderr = process.communicate(timeout=900)
        assert process.returncode == 0, f"espn index --shard failed:\n{stderr[-3000:]}"
    shutil.copytree(tmp / "parts.partial", tmp / "whole.partial")
    _run("index-merge", "--out", str(tmp / "whole"))
    _run("index-merge", "--out", str(tmp / "parts"), "--partitions", "2")
    return tmp / "whole", [tmp / "parts" / "part-0", tmp / "parts" / "part-1"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, index: Path, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("ESPN_")}
        env["HF_HUB_OFFLINE"] = "1"
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [*_espn(), "serve", str(index), "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                 "--torch-threads", "1"],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )

    def wait_ready(self, deadline: float) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                pytest.fail(f"espn serve exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            return HTTP.get(self.url + "/readyz").status_code == 200

        wait_until(ready, lambda: f"espn serve to be ready:\n{self.log.read_text()[-3000:]}",
                   timeout_s=max(0.0, deadline - time.monotonic()), interval_s=0.5, ignore=(httpx.TransportError,))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def servers(indexes: tuple[Path, list[Path]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    whole, parts = indexes
    logs = tmp_path_factory.mktemp("logs")
    started = [Server(index, logs / f"{index.name}.log") for index in [whole, *parts]]
    try:
        deadline = time.monotonic() + 300
        for server in started:
            server.wait_ready(deadline)
        yield {"whole": started[0], "parts": started[1:]}
    finally:
        for server in started:
            server.stop()


def _queries(n: int) -> list[str]:
    with open(SCIFACT / "queries.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line, _ in zip(f, range(n))]


def _exhaustive(indexes: tuple[Path, list[Path]], k: int) -> dict[str, int]:
    """Every cluster probed and every document re-ranked, in every index."""
    manifests = [json.loads((p / "manifest.json").read_text()) for p in [indexes[0], *indexes[1]]]
    assert {m["ann"]["nlist"] for m in manifests} == {NLIST}
    assert sum(m["counts"]["documents"] for m in manifests[1:]) == manifests[0]["counts"]["documents"] == SLICE
    return {"k": k, "nprobe": NLIST, "rerank_count": SLICE}


def _ranking(body: dict[str, Any]) -> list[tuple[str, float]]:
    return [(hit["id"], hit["score"]) for hit in body["results"]]


def _assert_same_ranking(got: list[tuple[str, float]], want: list[tuple[str, float]], where: str) -> None:
    assert [doc_id for doc_id, _ in got] == [doc_id for doc_id, _ in want], where
    assert [score for _, score in got] == pytest.approx([score for _, score in want], abs=1e-5), where


@pytest.mark.slow
def test_router_over_two_partitions_ranks_like_one_whole_index(
    indexes: tuple[Path, list[Path]], servers: dict[str, Any]
) -> None:
    params = _exhaustive(indexes, k=10)
    settings = RouterSettings(shards=[s.url for s in servers["parts"]], timeout_ms=60_000)
    queries = _queries(12)
    contributions = []
    with TestClient(build_router_app(settings)) as router:
        assert router.get("/readyz").json()["detail"] == "2 of 2 shard(s) ready"
        for query in queries:
            want = HTTP.post(servers["whole"].url + "/v1/search", json={"query": query, **params}, timeout=60)
            assert want.status_code == 200, want.text
            got = router.post("/v1/search", json={"query": query, **params})
            assert got.status_code == 200, got.text
            assert got.json()["partial"] is False
            _assert_same_ranking(_ranking(got.json()), _ranking(want.json()), query)
            # Both partitions contribute to the merged lists.
            sources = set()
            for part in servers["parts"]:
                own = HTTP.post(part.url + "/v1/search", json={"query": query, **params}, timeout=60).json()
                if {hit["id"] for hit in own["results"]} & {hit["id"] for hit in got.json()["results"]}:
                    sources.add(part.url)
            contributions.append(len(sources))
        assert max(contributions) == 2
        batch = router.post("/v1/search/batch", json={"queries": queries[:4], **params})
        assert batch.status_code == 200 and batch.json()["partial"] is False
        whole = HTTP.post(servers["whole"].url + "/v1/search/batch", json={"queries": queries[:4], **params},
                           timeout=60).json()
        for got_one, want_one in zip(batch.json()["responses"], whole["responses"]):
            _assert_same_ranking(_ranking(got_one), _ranking(want_one), got_one["query"])


@pytest.mark.slow
def test_router_fuses_hybrid_like_one_whole_index(indexes: tuple[Path, list[Path]], servers: dict[str, Any]) -> None:
    """Hybrid over two partitions against one index of the same slice, every document in both
    sides' pools: what differs is only BM25's corpus statistics, computed per partition.
    Tolerance: 9 of the top 10 in common on average and 7 on every query; the dense scores of
    the documents in common equal (same encoder, exhaustive search)."""
    params = {**_exhaustive(indexes, k=10), "mode": "hybrid"}
    settings = RouterSettings(shards=[s.url for s in servers["parts"]], timeout_ms=60_000)
    overlaps = []
    with TestClient(build_router_app(settings)) as router:
        for query in _queries(8):
            want = HTTP.post(servers["whole"].url + "/v1/search", json={"query": query, **params}, timeout=60).json()
            got = router.post("/v1/search", json={"query": query, **params})
            assert got.status_code == 200, got.text
            routed = {hit["id"]: hit for hit in got.json()["results"]}
            whole = {hit["id"]: hit for hit in want["results"]}
            assert len(routed) == 10
            overlaps.append(len(routed.keys() & whole.keys()))
            for doc_id in routed.keys() & whole.keys():
                assert routed[doc_id]["dense_score"] == pytest.approx(whole[doc_id]["dense_score"], abs=1e-4)
        lexical = router.post("/v1/search", json={"query": _queries(1)[0], "k": 5, "mode": "lexical"}).json()
        assert [hit["score"] for hit in lexical["results"]] == sorted((h["score"] for h in lexical["results"]),
                                                                      reverse=True)
    assert sum(overlaps) / len(overlaps) >= 9 and min(overlaps) >= 7, overlaps


@pytest.mark.slow
def test_router_answers_partially_when_a_shard_process_is_killed(
    indexes: tuple[Path, list[Path]], servers: dict[str, Any]
) -> None:
    params = _exhaustive(indexes, k=10)
    alive, victim = servers["parts"]
    settings = RouterSettings(shards=[alive.url, victim.url], timeout_ms=60_000)
    query = _queries(1)[0]
    alone = HTTP.post(alive.url + "/v1/search", json={"query": query, **params}, timeout=60).json()
    victim.process.kill()  # SIGKILL: no goodbye, the port just stops answering
    victim.process.wait(timeout=10)
    with TestClient(build_router_app(settings)) as router:
        response = router.post("/v1/search", json={"query": query, **params})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["partial"] is True
        assert [f["shard"] for f in body["failed_shards"]] == [victim.url]
        assert body["failed_shards"][0]["error"] == "unreachable"
        _assert_same_ranking(_ranking(body), _ranking(alone), "the surviving partition's own top-k")
        batch = router.post("/v1/search/batch", json={"queries": [query, query], **params}).json()
        assert batch["partial"] is True and batch["failed_shards"][0]["shard"] == victim.url
        ready = router.get("/readyz")
        assert ready.status_code == 200 and ready.json()["detail"] == "1 of 2 shard(s) ready"


def test_espn_route_command_serves_health_and_readiness(tmp_path: Path) -> None:
    """`espn route` as a process: flags parsed, uvicorn listening, no shard ready -> 503."""
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ESPN_")}
    log = tmp_path / "route.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [*_espn(), "route", "--shards", dead, "--timeout-ms", "300", "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    try:
        def listening() -> bool:
            assert process.poll() is None, f"espn route exited:\n{log.read_text()[-2000:]}"
            HTTP.get(f"http://127.0.0.1:{port}/healthz")
            return True

        wait_until(listening, lambda: f"espn route to listen:\n{log.read_text()[-2000:]}", timeout_s=60,
                   interval_s=0.3, ignore=(httpx.TransportError,))
        health = HTTP.get(f"http://127.0.0.1:{port}/healthz")
        assert health.status_code == 200
        ready = HTTP.get(f"http://127.0.0.1:{port}/readyz")
        assert ready.status_code == 503 and ready.json()["detail"] == "0 of 1 shard(s) ready"
        search = HTTP.post(f"http://127.0.0.1:{port}/v1/search", json={"query": "q"})
        assert search.status_code == 503 and search.json()["failed_shards"][0]["error"] == "unreachable"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    # uvicorn re-raises SIGTERM after a graceful shutdown, so -SIGTERM is a clean exit too.
    assert process.returncode in (0, -signal.SIGTERM), log.read_text()[-2000:]
    assert "Shutting down" in log.read_text()
