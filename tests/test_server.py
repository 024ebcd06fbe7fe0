"""The HTTP server, tested as users meet it: a real `espn serve` process on a loopback port.

Unit tests of the micro-batcher and the settings need no index; everything else runs
against a server started on the sample-corpus index (conftest's session `sample_index`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import httpx
import pytest

from espn.params import MAX_QUERY_CHARS
from espn_server.settings import ServerSettings

from helpers import HTTP_TIMEOUT_S, wait_until
from server_fixtures import HTTP, ServerProcess, running_server

API_KEY = "test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUERIES = [
    "how do vaccines train the immune system",
    "effects of climate change on ocean temperature",
    "neural networks for image recognition",
    "causes of the french revolution",
    "what is the speed of light",
    "protein folding and amino acids",
    "history of the roman empire",
    "solar panels convert sunlight to electricity",
]

ROOT = Path(__file__).resolve().parents[1]


# -- settings (no index) -----------------------------------------------------------


# -- the search fast path (no index) ------------------------------------------------------


def _through_fast_path(method: str, path: str, body: bytes, content_type: bytes | None,
                       tmp_path: Path) -> tuple[int, list]:
    """(status, what reached the app behind SearchFastPath) for one request, in process."""
    from espn.engine import ServeConfig, open_engines
    from espn_server.search_fast_path import SearchFastPath

    reached: list[tuple[str, bytes]] = []

    async def behind(scope, receive, send) -> None:  # stands for FastAPI: records and answers 299
        reached.append((scope["path"], (await receive())["body"]))
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    # A registry not started: a search the fast path takes ends in the engine's own 503 ("starting").
    (tmp_path / "manifest.json").write_text("{}")
    fast = SearchFastPath(behind, open_engines(ServeConfig(indexes={"default": tmp_path}, default="default")))
    headers = [(b"content-type", content_type)] if content_type is not None else []
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(fast(scope, receive, send))
    return sent[0]["status"], reached


def test_the_search_fast_path_takes_valid_json_searches_only(tmp_path: Path) -> None:
    search = b'{"query": "x", "k": 3}'
    for path in ("/v1/search", "/v1/indexes/default/search"):
        for content_type in (b"application/json", b"Application/JSON; charset=utf-8"):
            status, reached = _through_fast_path("POST", path, search, content_type, tmp_path)
            assert (status, reached) == (503, [])  # its own answer: the handler of "index is not open"
    status, reached = _through_fast_path("POST", "/v1/indexes/nope/search", search, b"application/json", tmp_path)
    assert (status, reached) == (404, [])  # an index it does not hold
    for method, path, body, content_type in [
        ("POST", "/v1/search", b'{"query": "x", ', b"application/json"),  # malformed: FastAPI's 400
        ("POST", "/v1/search", b'{"k": 3}', b"application/json"),  # invalid: FastAPI's 422
        ("POST", "/v1/search", b'{"query": "caf\xe9"}', b"application/json"),  # not UTF-8
        ("POST", "/v1/search", search, b"text/plain"),  # FastAPI's 415
        ("POST", "/v1/search", search, None),  # no Content-Type: FastAPI's 415
        ("POST", "/v1/search", search, b"application/vnd.espn+json"),  # JSON to FastAPI, not to the fast path
        ("POST", "/v1/search/batch", b'{"queries": ["x"]}', b"application/json"),
        ("PUT", "/v1/search", search, b"application/json"),
        ("POST", "/v1/indexes/a/b/search", search, b"application/json"),  # no index name: FastAPI's 404
    ]:
        status, reached = _through_fast_path(method, path, body, content_type, tmp_path)
        assert (status, reached) == (299, [(path, body)]), (method, path, body, content_type)


def test_the_access_log_labels_by_route_template_and_remembers_only_static_paths() -> None:
    from fastapi import FastAPI

    from espn_server.errors import flat_routes
    from espn_server.middleware import AccessMiddleware
    from espn_server.routes import documents, search

    app = FastAPI()
    for router in (search.router, documents.router):
        app.include_router(router, prefix="/v1")
        app.include_router(router, prefix="/v1/indexes/{index}")
    access = AccessMiddleware(None, None, flat_routes(app))  # type: ignore[arg-type]

    def label(method: str, path: str) -> str:
        return access._endpoint({"type": "http", "method": method, "path": path, "root_path": ""})

    assert [label("POST", "/v1/search") for _ in range(2)] == ["/v1/search"] * 2
    assert {label("GET", f"/v1/documents/d{i}") for i in range(50)} == {"/v1/documents/{doc_id}"}
    assert label("GET", "/v1/search") == "/v1/search"  # the right path with a wrong method: still its template
    assert label("GET", "/nowhere") == "other"
    assert label("POST", "/v1/indexes/a/search") == "/v1/indexes/{index}/search"
    assert set(access._static) == {("POST", "/v1/search")}  # no document id, no unknown path kept


@pytest.fixture()
def fake_index(tmp_path: Path) -> Path:
    (tmp_path / "manifest.json").write_text("{}")
    return tmp_path


def test_settings_from_environment(fake_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESPN_INDEX", str(fake_index))
    monkeypatch.setenv("ESPN_PORT", "9123")
    monkeypatch.setenv("ESPN_CORS_ORIGINS", "https://a.example, https://b.example")
    monkeypatch.setenv("ESPN_API_KEY", API_KEY)
    settings = ServerSettings()
    assert settings.port == 9123 and settings.index == fake_index.resolve()
    assert settings.cors_origins == ["https://a.example", "https://b.example"]
    assert settings.describe()["api_key"] == "***" and API_KEY not in json.dumps(settings.describe())
    # to_env() is how `espn serve` hands the settings to its workers: it must round-trip.
    for key in list(os.environ):
        if key.startswith("ESPN_"):
            monkeypatch.delenv(key)
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    assert ServerSettings() == settings


@pytest.mark.parametrize(
    "env, field",
    [
        ({"ESPN_INDEX": "/nonexistent/index"}, "index"),
        ({"ESPN_READER": "floppy"}, "reader"),
        ({"ESPN_PORT": "70000"}, "port"),
        ({"ESPN_WORKERS": "0"}, "workers"),
        ({"ESPN_API_KEY": "short"}, "api_key"),
        ({"ESPN_MAX_BATCH_SIZE": "2000"}, "max_batch_size"),
    ],
)
def test_settings_fail_fast(fake_index: Path, monkeypatch: pytest.MonkeyPatch, env: dict, field: str) -> None:
    monkeypatch.setenv("ESPN_INDEX", str(fake_index))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=field):
        ServerSettings()


def test_serve_refuses_a_missing_index(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "espn_server", str(tmp_path / "nope"), "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "not an ESPN index directory" in done.stderr


# -- a real server on the sample index ---------------------------------------------


@pytest.fixture(scope="session")
def searcher(sample_index: Path):
    from espn import Searcher

    opened = Searcher.open(sample_index)
    yield opened
    opened.close()


@pytest.fixture(scope="module")
def server(sample_index: Path, tmp_path_factory: pytest.TempPathFactory):
    """One worker, API key on, short batching window."""
    with running_server(sample_index, tmp_path_factory.mktemp("logs"), "--batch-wait-ms", "5",
                        env={"ESPN_API_KEY": API_KEY}, name="main") as running:
        yield running


@pytest.fixture()
def client(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60.0) as http:
        yield http


def _ids_and_scores(results: list[dict]) -> tuple[list[str], list[float]]:
    return [hit["id"] for hit in results], [hit["score"] for hit in results]


def _assert_same_ranking(got: list[dict], want: list[dict]) -> None:
    got_ids, got_scores = _ids_and_scores(got)
    want_ids, want_scores = _ids_and_scores(want)
    assert got_ids == want_ids
    assert got_scores == pytest.approx(want_scores, abs=1e-5)


def test_health_ready_and_docs(client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready"
    assert ready["reader"]["reader"] == "posix" and ready["reader"]["engine"] in ("io_uring", "aio", "threads")
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    for path in ("/v1/search", "/v1/search/batch", "/v1/documents/{doc_id}", "/healthz", "/readyz", "/metrics"):
        assert path in spec["paths"]
    bounds = spec["components"]["schemas"]["SearchRequest"]["properties"]["k"]
    assert bounds["minimum"] == 1 and bounds["maximum"] == 1000


def test_search_equals_library(client: httpx.Client, searcher) -> None:
    for query in QUERIES[:4]:
        response = client.post("/v1/search", json={"query": query, "k": 10})
        assert response.status_code == 200, response.text
        body = response.json()
        (expected,) = searcher.search([query], k=10)
        want = [{"id": h.doc_id, "score": h.score, "cls_score": h.cls_score, "bow_score": h.bow_score}
                for h in expected.hits]
        _assert_same_ranking(body["results"], want)
        for got, hit in zip(body["results"], want):
            assert got["cls_score"] == pytest.approx(hit["cls_score"], abs=1e-5)
            assert (got["bow_score"] is None) == (hit["bow_score"] is None)
        stats = body["stats"]
        assert stats["stage_ms"]["total"] > 0 and 0.0 <= stats["hit_rate"] <= 1.0
        assert stats["batch_size"] >= 1 and body["query"] == query


VIA_FASTAPI = {"Content-Type": "application/vnd.espn+json"}


def test_the_search_fast_path_answers_as_the_fastapi_route(client: httpx.Client) -> None:
    """The same request through SearchFastPath (Content-Type: application/json) and through
    FastAPI's route (a `+json` type, which FastAPI parses as JSON and the fast path leaves to
    it): the same answer, and the same error for a search the index refuses."""
    timing = ("stage_ms", "queue_ms", "batch_size", "hit_rate")
    for request in ({"query": QUERIES[1], "k": 5, "return_text": True},
                    {"query": QUERIES[4], "k": 3, "filter": {"topic": "astronomy"}},
                    {"query": QUERIES[3], "k": 2, "explain": True}):
        body = json.dumps(request).encode()
        fast = client.post("/v1/search", content=body, headers={"Content-Type": "application/json"})
        routed = client.post("/v1/search", content=body, headers=VIA_FASTAPI)
        assert fast.status_code == routed.status_code == 200, (fast.text[:300], routed.text[:300])
        got, want = fast.json(), routed.json()
        assert got["results"], got
        for answer in (got, want):
            answer["stats"] = {key: value for key, value in answer["stats"].items() if key not in timing}
        assert got == want
    refused = json.dumps({"query": "x", "nprobe": 1 << 20}).encode()
    fast = client.post("/v1/search", content=refused, headers={"Content-Type": "application/json"})
    routed = client.post("/v1/search", content=refused, headers=VIA_FASTAPI)
    assert fast.status_code == routed.status_code == 422 and fast.json() == routed.json()
    assert fast.json()["error"] == "invalid_parameter"


def test_search_parameters_and_text(client: httpx.Client, searcher) -> None:
    query = QUERIES[1]
    params = {"k": 5, "nprobe": 2, "prefetch_step": 0.5, "rerank_count": 3}
    body = client.post("/v1/search", json={"query": query, "return_text": True, **params}).json()
    (expected,) = searcher.search([query], **params)
    _assert_same_ranking(body["results"], [{"id": h.doc_id, "score": h.score} for h in expected.hits])
    assert len(body["results"]) == 5
    assert all(hit["bow_score"] is None for hit in body["results"][3:])
    for hit in body["results"]:
        assert hit["text"] == searcher.document(hit["id"]).text


def test_prefetch_switches_keep_the_ranking(client: httpx.Client) -> None:
    query = QUERIES[2]
    default = client.post("/v1/search", json={"query": query, "k": 10}).json()
    for switch in ({"prefetch": False}, {"prefetch_waves": 1, "prefetch_step": 0.2}):
        body = client.post("/v1/search", json={"query": query, "k": 10, **switch}).json()
        _assert_same_ranking(body["results"], default["results"])
    off = client.post("/v1/search", json={"query": query, "k": 10, "prefetch": False}).json()
    assert off["stats"]["prefetched"] == 0
    assert client.post("/v1/search", json={"query": query, "prefetch": "no"}).status_code == 422


def test_first_stage_parameters_over_http(client: httpx.Client, searcher) -> None:
    """The first-stage switches reach the library: ivf is this index's own stage (same ranking as the
    default); centroids on an index built without them is the library's 422 naming the parameter."""
    query = QUERIES[2]
    default = client.post("/v1/search", json={"query": query, "k": 10}).json()
    ivf = client.post("/v1/search", json={"query": query, "k": 10, "first_stage": "ivf"}).json()
    _assert_same_ranking(ivf["results"], default["results"])
    refused = client.post("/v1/search", json={"query": query, "first_stage": "centroids"})
    assert refused.status_code == 422 and "first_stage" in refused.json()["message"]
    assert client.post("/v1/search", json={"query": query, "first_stage": "pq"}).status_code == 422
    assert client.post("/v1/search", json={"query": query, "first_stage_probe": 0}).status_code == 422


def test_batch_equals_single_requests(client: httpx.Client) -> None:
    batch = client.post("/v1/search/batch", json={"queries": QUERIES, "k": 7})
    assert batch.status_code == 200, batch.text
    responses = batch.json()["responses"]
    assert [r["query"] for r in responses] == QUERIES
    for query, response in zip(QUERIES, responses):
        single = client.post("/v1/search", json={"query": query, "k": 7}).json()
        _assert_same_ranking(response["results"], single["results"])


def test_document_lookup(client: httpx.Client, searcher) -> None:
    hit = client.post("/v1/search", json={"query": QUERIES[0], "k": 1}).json()["results"][0]
    document = client.get(f"/v1/documents/{hit['id']}")
    assert document.status_code == 200
    expected = searcher.document(hit["id"])
    assert document.json() == {"id": expected.doc_id, "title": expected.title, "text": expected.text,
                               "metadata": expected.metadata}
    # The sample corpus carries metadata on every line: the read gives it back as the corpus had it.
    line = next(json.loads(row) for row in (ROOT / "espn" / "data" / "sample_corpus.jsonl").read_text().splitlines()
                if json.loads(row)["_id"] == hit["id"])
    assert document.json()["metadata"] == line["metadata"] and line["metadata"]


BAD_INPUTS = [
    # (name, method, path, body bytes or JSON, content type, status, error code)
    ("malformed JSON", "POST", "/v1/search", b'{"query": "x", ', "application/json", 400, "malformed_json"),
    ("not an object", "POST", "/v1/search", b'["x"]', "application/json", 422, "invalid_request"),
    ("missing query", "POST", "/v1/search", {"k": 3}, None, 422, "invalid_request"),
    ("empty query", "POST", "/v1/search", {"query": ""}, None, 422, "invalid_request"),
    ("blank query", "POST", "/v1/search", {"query": "   "}, None, 422, "invalid_request"),
    ("query is a number", "POST", "/v1/search", {"query": 42}, None, 422, "invalid_request"),
    ("k is a string", "POST", "/v1/search", {"query": "x", "k": "10"}, None, 422, "invalid_request"),
    ("k is a float", "POST", "/v1/search", {"query": "x", "k": 2.5}, None, 422, "invalid_request"),
    ("k = 0", "POST", "/v1/search", {"query": "x", "k": 0}, None, 422, "invalid_request"),
    ("k = 10^6", "POST", "/v1/search", {"query": "x", "k": 10**6}, None, 422, "invalid_request"),
    ("unknown field", "POST", "/v1/search", {"query": "x", "topk": 3}, None, 422, "invalid_request"),
    ("prefetch_step 0", "POST", "/v1/search", {"query": "x", "prefetch_step": 0}, None, 422, "invalid_request"),
    ("prefetch_step NaN", "POST", "/v1/search", b'{"query": "x", "prefetch_step": NaN}', "application/json", 422,
     "invalid_request"),
    ("text/plain body", "POST", "/v1/search", b'{"query": "x"}', "text/plain", 415, "unsupported_media_type"),
    ("form body", "POST", "/v1/search", b"query=x", "application/x-www-form-urlencoded", 415,
     "unsupported_media_type"),
    ("work over budget", "POST", "/v1/search/batch", {"queries": ["q"] * 256, "k": 1000, "rerank_count": 10000,
     "prefetch_k": 10000}, None, 422, "over_budget"),
    ("response over budget", "POST", "/v1/search/batch", {"queries": ["q"] * 200, "k": 1000, "return_text": True},
     None, 422, "over_budget"),
    ("nprobe > nlist", "POST", "/v1/search", {"query": "x", "nprobe": 1 << 20}, None, 422, "invalid_parameter"),
    ("query too long", "POST", "/v1/search", {"query": "x" * (MAX_QUERY_CHARS + 1)}, None, 422, "invalid_request"),
    ("10 MB body", "POST", "/v1/search", b'{"query": "' + b"a" * (10 << 20) + b'"}', "application/json", 413,
     "body_too_large"),
    ("invalid UTF-8", "POST", "/v1/search", b'{"query": "caf\xe9 \xff"}', "application/json", 400, "invalid_utf8"),
    ("batch of 10^5", "POST", "/v1/search/batch", {"queries": ["q"] * 100_000}, None, 422, "invalid_request"),
    ("batch over limit", "POST", "/v1/search/batch", {"queries": ["q"] * 257}, None, 422, "invalid_request"),
    ("empty batch", "POST", "/v1/search/batch", {"queries": []}, None, 422, "invalid_request"),
    ("batch of numbers", "POST", "/v1/search/batch", {"queries": [1, 2]}, None, 422, "invalid_request"),
    ("unknown document", "GET", "/v1/documents/no-such-doc-123", None, None, 404, "document_not_found"),
    ("unknown route", "GET", "/v1/nothing", None, None, 404, "not_found"),
    ("wrong method", "GET", "/v1/search", None, None, 405, "method_not_allowed"),
]


@pytest.mark.parametrize("name, method, path, body, content_type, status, code", BAD_INPUTS,
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_gets_a_json_4xx(client: httpx.Client, name: str, method: str, path: str, body: Any,
                                   content_type: str | None, status: int, code: str) -> None:
    kwargs: dict[str, Any] = {}
    if isinstance(body, bytes):
        kwargs = {"content": body, "headers": {"Content-Type": content_type}}
    elif body is not None:
        kwargs = {"json": body}
    response = client.request(method, path, **kwargs)
    assert response.status_code == status, response.text[:500]
    payload = response.json()
    assert payload["error"] == code and isinstance(payload["message"], str) and payload["message"]
    assert "Traceback" not in response.text
    # ... and the server goes on answering normally.
    after = client.post("/v1/search", json={"query": QUERIES[0], "k": 3})
    assert after.status_code == 200 and len(after.json()["results"]) == 3


@pytest.mark.parametrize("method, path, allowed", [
    ("GET", "/v1/search", "POST"),
    ("PUT", "/v1/search", "POST"),
    ("DELETE", "/v1/search", "POST"),
    ("GET", "/v1/search/batch", "POST"),
    ("POST", "/v1/documents/x", "GET, PUT, DELETE"),
    ("PATCH", "/v1/documents/x", "GET, PUT, DELETE"),
    ("GET", "/v1/documents/batch", "POST"),
    ("PATCH", "/v1/documents/batch", "POST"),
    ("PUT", "/v1/snapshots", "GET, POST"),
    ("POST", "/healthz", "GET"),
])
def test_every_405_names_the_methods_the_path_takes(client: httpx.Client, method: str, path: str,
                                                    allowed: str) -> None:
    refused = client.request(method, path)
    assert refused.status_code == 405 and refused.json()["error"] == "method_not_allowed"
    assert refused.headers["allow"] == allowed
    assert method in refused.json()["message"] and allowed in refused.json()["message"]
    for other in allowed.split(", "):  # every method Allow names is taken (no body: a 4xx that writes nothing)
        assert client.request(other, path).status_code != 405, other


def test_api_key_is_required(server) -> None:
    query = {"query": QUERIES[0], "k": 1}
    assert HTTP.post(f"{server.base_url}/v1/search", json=query).status_code == 401
    wrong = HTTP.post(f"{server.base_url}/v1/search", json=query, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"] == "unauthorized"
    assert wrong.headers["www-authenticate"] == "Bearer"
    assert HTTP.get(f"{server.base_url}/v1/documents/x").status_code == 401
    assert HTTP.get(f"{server.base_url}/healthz").status_code == 200  # probes need no key
    # CORS is off unless configured: no Access-Control headers, even for a preflight.
    preflight = httpx.options(f"{server.base_url}/v1/search", timeout=HTTP_TIMEOUT_S, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


def test_concurrent_clients_match_serial(client: httpx.Client, server) -> None:
    serial = {}
    for query in QUERIES:
        serial[query] = client.post("/v1/search", json={"query": query, "k": 10}).json()["results"]

    errors: list[str] = []
    batch_sizes: list[int] = []
    lock = threading.Lock()

    serial_k7 = {query: client.post("/v1/search", json={"query": query, "k": 7}).json()["results"]
                 for query in QUERIES}

    def worker(worker_id: int) -> None:
        k = 7 if worker_id % 4 == 0 else 10  # two parameter sets: they share calls as groups
        with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60.0) as http:
            for i in range(50):
                query = QUERIES[(worker_id + i) % len(QUERIES)]
                response = http.post("/v1/search", json={"query": query, "k": k})
                with lock:
                    if response.status_code != 200:
                        errors.append(f"{response.status_code}: {response.text[:200]}")
                        continue
                    body = response.json()
                    batch_sizes.append(body["stats"]["batch_size"])
                    try:
                        _assert_same_ranking(body["results"], (serial_k7 if k == 7 else serial)[query])
                    except AssertionError as mismatch:
                        errors.append(f"{query!r}: {mismatch}")

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(worker, range(16)))
    assert errors == []
    assert len(batch_sizes) == 16 * 50
    assert max(batch_sizes) > 1, "concurrent requests were never micro-batched"


def _sigterm_during_a_long_batch(server: ServerProcess, queries: int = 256, k: int = 100) -> httpx.Response:
    """SIGTERM the server while a batch of `queries` is in flight; that batch's response."""
    base = server.base_url
    outcome: dict[str, httpx.Response] = {}

    def long_request() -> None:
        body = {"queries": [f"{QUERIES[i % 8]} {i}" for i in range(queries)], "k": k, "rerank_count": 100}
        outcome["response"] = HTTP.post(f"{base}/v1/search/batch", json=body, timeout=120.0)

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_until(lambda: _metric(HTTP.get(f"{base}/metrics").text, "espn_http_requests_in_flight",
                               endpoint="/v1/search/batch") >= 1,
               "the batch request to show as in flight", timeout_s=30, interval_s=0.005)
    os.kill(server.pid, signal.SIGTERM)
    thread.join(120)
    return outcome["response"]


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(key) == value for key, value in labels.items()):
            total += float(match.group(3))
    return total


def _metrics_once(url: str, done: Callable[[str], bool], timeout_s: float = 30.0) -> str:
    """/metrics at `url` once `done(text)` holds. A worker records a request
    just after writing its answer, and another process may serve /metrics (another worker, or the
    --metrics-port server): the last request's counts can lag the client by a moment."""
    text = ""

    def arrived() -> bool:
        nonlocal text
        text = HTTP.get(url).text
        return done(text)

    wait_until(arrived, f"the last request's counts in {url}", timeout_s, interval_s=0.05)
    return text


def test_metrics_move(client: httpx.Client) -> None:
    before = client.get("/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    for query in QUERIES[:3]:
        assert client.post("/v1/search", json={"query": query}).status_code == 200
    assert client.post("/v1/search", json={"query": ""}).status_code == 422
    after = client.get("/metrics").text
    requests = {"endpoint": "/v1/search", "method": "POST"}
    assert _metric(after, "espn_http_requests_total", status="200", **requests) - \
        _metric(before.text, "espn_http_requests_total", status="200", **requests) == 3
    assert _metric(after, "espn_http_requests_total", status="422", **requests) - \
        _metric(before.text, "espn_http_requests_total", status="422", **requests) == 1
    assert _metric(after, "espn_search_queries_total") - _metric(before.text, "espn_search_queries_total") == 3
    assert _metric(after, "espn_prefetch_hit_rate_count") - _metric(before.text, "espn_prefetch_hit_rate_count") == 3
    assert _metric(after, "espn_search_stage_duration_seconds_count", stage="total") > 0
    assert _metric(after, "espn_search_batch_size_count") > 0
    assert _metric(after, "espn_read_bytes_total") >= _metric(before.text, "espn_read_bytes_total")
    assert "espn_http_requests_in_flight" in after and "espn_http_request_duration_seconds_bucket" in after
    # The posix reader's prefetch planner says what it decided (which way depends on the machine:
    # this worker has served other tests' searches) and on what terms.
    assert _metric(after, "espn_prefetch_waves_pay") in (0, 1) and "espn_prefetch_waves_pay " in after
    assert _metric(after, "espn_prefetch_estimate_ms", term="outcome_model") > 0


def test_request_log_is_one_json_line_per_request(client: httpx.Client, server) -> None:
    response = client.post("/v1/search", json={"query": QUERIES[2]}, headers={"X-Request-ID": "trace-abc.123"})
    assert response.headers["x-request-id"] == "trace-abc.123"

    def logged() -> list[dict]:
        return [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]

    # The access line follows the answer.
    wait_until(lambda: any(line.get("request_id") == "trace-abc.123" for line in logged()),
               "the request's access line", timeout_s=5)
    lines = logged()
    mine = [line for line in lines if line.get("request_id") == "trace-abc.123"]
    assert len(mine) == 1
    (line,) = mine
    assert line["status"] == 200 and line["endpoint"] == "/v1/search" and line["queries"] == 1
    assert line["duration_ms"] > 0
    # The settings were printed once, at start-up, with the key masked.
    settings_lines = [line for line in lines if line.get("event") == "settings"]
    assert len(settings_lines) == 1 and settings_lines[0]["api_key"] == "***"
    assert API_KEY not in server.log()


# -- several workers: shared metrics, CORS, graceful shutdown -------------------------


def test_workers_share_metrics_and_drain_on_sigterm(sample_index: Path, tmp_path: Path) -> None:
    with running_server(sample_index, tmp_path, "--workers", "2", "--cors-origin", "https://app.example",
                        name="workers") as server:
        base = server.base_url
        # Connections spread over both workers; /metrics must count all of them.
        for query in QUERIES:
            with httpx.Client(base_url=base, timeout=60.0) as fresh:
                assert fresh.post("/v1/search", json={"query": query}).status_code == 200
        text = _metrics_once(f"{base}/metrics", lambda text: _metric(
            text, "espn_http_requests_total", endpoint="/v1/search", status="200") >= len(QUERIES) and _metric(
            text, "espn_search_queries_total") >= len(QUERIES))
        assert _metric(text, "espn_http_requests_total", endpoint="/v1/search", status="200") == len(QUERIES)
        assert _metric(text, "espn_search_queries_total") == len(QUERIES)

        cors = HTTP.post(f"{base}/v1/search", json={"query": "x"}, headers={"Origin": "https://app.example"})
        assert cors.headers["access-control-allow-origin"] == "https://app.example"

        # A long batch is in flight when SIGTERM arrives: it must still complete.
        response = _sigterm_during_a_long_batch(server)
        assert response.status_code == 200, response.text[:300]
        assert len(response.json()["responses"]) == 256
        assert server.process.wait(60) == 0


# -- issue 12: what a user meets ----------------------------------------------------------


def test_error_messages_name_the_cause(client: httpx.Client) -> None:
    nan = client.post("/v1/search", content=b'{"query": "x", "prefetch_step": NaN}',
                      headers={"Content-Type": "application/json"})
    assert "prefetch_step" in nan.json()["message"] and "finite" in nan.json()["message"]
    plain = client.post("/v1/search", content=b'{"query": "x"}', headers={"Content-Type": "text/plain"})
    assert "text/plain" in plain.json()["message"] and "application/json" in plain.json()["message"]
    work = client.post("/v1/search/batch", json={"queries": ["q"] * 256, "k": 1000, "rerank_count": 10000})
    assert "ESPN_MAX_REQUEST_WORK" in work.json()["message"] and "2560000" in work.json()["message"]


def test_stats_and_metrics_name_the_read_engine(client: httpx.Client) -> None:
    stats = client.post("/v1/search", json={"query": QUERIES[0], "k": 5}).json()["stats"]
    engine = client.get("/readyz").json()["reader"]["engine"]
    assert stats["engine"] == engine and stats["read_amplification"] >= 1.0
    text = client.get("/metrics").text
    assert _metric(text, "espn_reader_info", reader="posix", engine=engine) == 1


def test_docs_work_offline(client: httpx.Client) -> None:
    page = client.get("/docs")
    assert page.status_code == 200 and "swagger" in page.text.lower()
    urls = re.findall(r"""(?:src|href|url)\s*[:=]\s*['"]([^'"]+)['"]""", page.text)
    assert urls and not [u for u in urls if "//" in u], f"external assets in /docs: {urls}"
    for url in urls:
        response = client.get(url)
        assert response.status_code == 200, url
        assert len(response.content) > (100_000 if url.endswith("bundle.js") else 0), url


@pytest.fixture(scope="module")
def open_server(sample_index: Path, tmp_path_factory: pytest.TempPathFactory):
    """All interfaces, no API key, a 1 s batch wait: one start serves the two tests below (each
    server start costs 10 s and more on a 2-core machine)."""
    with running_server(sample_index, tmp_path_factory.mktemp("open"), "--host", "0.0.0.0", "--batch-wait-ms",
                        "1000", name="open") as running:
        yield running


def test_an_idle_server_searches_at_once_and_batches_what_queues(open_server: ServerProcess) -> None:
    """Over real HTTP: a 1 s batch wait is never spent by a query that finds the server idle, and
    concurrent requests that arrive while a search runs share the next search call."""
    url = f"{open_server.base_url}/v1/search"
    alone = HTTP.post(url, json={"query": QUERIES[0], "k": 3}, timeout=60)
    assert alone.status_code == 200, alone.text
    assert alone.json()["stats"]["batch_size"] == 1 and alone.json()["stats"]["queue_ms"] < 500
    # Eight clients at once, in up to five bursts: on a loaded machine one burst's requests can
    # reach an idle server one by one; batching that never happens fails all five.
    together: list[httpx.Response] = []
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for _ in range(5):
            together += pool.map(lambda i: HTTP.post(url, json={"query": QUERIES[i % len(QUERIES)], "k": 3},
                                                      timeout=60), range(8))
            if max(response.json()["stats"]["batch_size"] for response in together) > 1:
                break
    assert all(response.status_code == 200 for response in together)
    assert max(response.json()["stats"]["batch_size"] for response in together) > 1


def test_serving_on_all_interfaces_without_a_key_warns(open_server: ServerProcess, server: ServerProcess) -> None:
    """Warned once at start on all interfaces without a key; never with a key (the module's server)."""
    warnings = [json.loads(line) for line in open_server.log().splitlines() if '"unauthenticated"' in line]
    assert len(warnings) == 1 and "ESPN_API_KEY" in warnings[0]["message"]
    assert "unauthenticated" not in server.log()


def test_metrics_on_their_own_port(sample_index: Path, tmp_path: Path) -> None:
    from server_fixtures import free_port

    port = free_port()
    with running_server(sample_index, tmp_path, "--metrics-port", str(port), env={"ESPN_API_KEY": API_KEY},
                        name="metrics-port") as server:
        # A fresh posix worker says its prefetch verdict before any search: waves are tried.
        assert _metric(HTTP.get(f"http://127.0.0.1:{port}/metrics").text, "espn_prefetch_waves_pay") == 1
        assert HTTP.post(f"{server.base_url}/v1/search", json={"query": QUERIES[1]}, headers=AUTH,
                          timeout=60).status_code == 200
        assert HTTP.get(f"{server.base_url}/metrics").status_code == 404
        text = _metrics_once(f"http://127.0.0.1:{port}/metrics", lambda text: _metric(
            text, "espn_http_requests_total", endpoint="/v1/search", status="200") >= 1 and _metric(
            text, "espn_search_queries_total") >= 1)
        assert _metric(text, "espn_http_requests_total", endpoint="/v1/search", status="200") == 1
        assert _metric(text, "espn_search_queries_total") == 1


def test_shutdown_past_the_grace_period_answers_503_and_exits_0(sample_index: Path, tmp_path: Path) -> None:
    # A batch far longer than the 1 s of grace, however fast the machine encodes and scores.
    with running_server(sample_index, tmp_path, "--graceful-timeout", "1", "--max-batch-queries", "2500",
                        name="deadline") as server:
        response = _sigterm_during_a_long_batch(server, queries=2500, k=10)
        assert server.process.wait(60) == 0
        log = server.log()
    assert response.status_code == 503, response.text[:300]
    assert response.json()["error"] == "shutting_down"
    assert "Traceback" not in log and "CancelledError" not in log


def test_an_index_of_precomputed_embeddings_becomes_ready(tmp_path: Path) -> None:
    import numpy as np

    from helpers import run_espn

    rng = np.random.default_rng(0)
    source = tmp_path / "src"
    for folder in ("CLS", "BOW"):
        (source / folder).mkdir(parents=True)
    counts = rng.integers(1, 5, size=20)
    np.save(source / "CLS" / "0.npy", rng.normal(size=(20, 16)).astype(np.float16))
    np.save(source / "BOW" / "0.npy", rng.normal(size=(int(counts.sum()), 8)).astype(np.float16))
    (source / "BOW" / "0.json").write_text(json.dumps(counts.tolist()))
    run_espn("index", "--embeddings", source, "--out", tmp_path / "index", "--nlist", "1")
    with running_server(tmp_path / "index", tmp_path, name="precomputed") as server:  # waits for /readyz 200
        assert HTTP.get(f"{server.base_url}/readyz").json()["status"] == "ready"
        assert HTTP.get(f"{server.base_url}/v1/documents/3").status_code == 200


def test_serve_on_a_corrupted_index_is_one_line(sample_index: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "index"
    shutil.copytree(sample_index, copy)
    with open(copy / "records.npy", "r+b") as f:
        f.truncate(f.seek(0, 2) - 8)
    done = subprocess.run([sys.executable, "-m", "espn_server", str(copy), "--port", "0"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "records.npy" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_the_prefetch_verdict_and_terms_are_gauges(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the cost model decided reaches /metrics as it is (0 for a reader that takes no waves)."""
    from espn.prefetch import PrefetchModel
    from espn_server.metrics import MULTIPROC_ENV, ServerMetrics

    monkeypatch.delenv(MULTIPROC_ENV, raising=False)
    metrics = ServerMetrics()
    model = PrefetchModel()
    for _ in range(20):  # the model's searches slower than plain ones by far: waves stop
        model.observe_outcome(True, 3.0)
        model.observe_outcome(False, 2.0)
    model.observe_submit(50, 0.25)
    metrics.set_prefetch(model.estimates)
    text = metrics.render().decode()
    assert _metric(text, "espn_prefetch_waves_pay") == 0
    assert _metric(text, "espn_prefetch_estimate_ms", term="outcome_model") == pytest.approx(3.0)
    assert _metric(text, "espn_prefetch_estimate_ms", term="outcome_plain") == pytest.approx(2.0)
    assert 'term="read_latency"' not in text  # not measured yet: not exported
    metrics.set_prefetch(PrefetchModel().estimates)
    assert _metric(metrics.render().decode(), "espn_prefetch_waves_pay") == 1
    metrics.set_prefetch(None)
    assert _metric(metrics.render().decode(), "espn_prefetch_waves_pay") == 0
