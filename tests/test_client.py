"""The typed client (clients/python, `espn_client`) against a real `espn serve` of the sample index.

Every route through the sync and the async client, with every request recorded and held to the
path+method list of the server's live OpenAPI document; answers compared with raw HTTP's; error
answers as exceptions carrying the server's code and message. Retries and timeouts run against a
tiny HTTP server on loopback that answers 503/507 with Retry-After (or stalls) on cue: a real
server, whose answers are chosen.
(The models against the OpenAPI document and the sync client against the async one:
tests/test_client_contract.py; hostile answers: tests/test_client_bounds.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from conftest import CLIENT_API_KEY
from helpers import HTTP_TIMEOUT_S

import espn_client
from espn_client import (AsyncClient, Client, ConflictError, InvalidRequestError, NotFoundError, RequestTimeoutError,
                         RetryPolicy, UnauthorizedError, UnavailableError, InsufficientStorageError)
from espn_client import models

ROOT = Path(__file__).resolve().parents[1]
AUTH = {"Authorization": f"Bearer {CLIENT_API_KEY}"}
QUERY = "what causes ocean tides"
FILTER = {"topic": {"in": ["oceans", "weather"]}}


@pytest.fixture(scope="module")
def server(client_server):
    return client_server


@pytest.fixture(scope="module")
def raw(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=HTTP_TIMEOUT_S) as http:
        yield http


@pytest.fixture(scope="module")
def openapi(raw: httpx.Client) -> dict[str, Any]:
    return raw.get("/openapi.json").json()


class Recorder:
    """The (method, path) of every request a client sends, through httpx's event hooks."""

    def __init__(self) -> None:
        self.sent: set[tuple[str, str]] = set()

    def hook(self, request: httpx.Request) -> None:
        self.sent.add((request.method.lower(), request.url.raw_path.decode().split("?")[0]))

    async def ahook(self, request: httpx.Request) -> None:
        self.hook(request)

    def covered(self, openapi: dict[str, Any]) -> set[tuple[str, str]]:
        """The document's (method, path template) pairs that no recorded request matched."""
        missing = set()
        for template, operations in openapi["paths"].items():
            pattern = re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$")
            for method in operations:
                if not any(m == method and pattern.match(p) for m, p in self.sent):
                    missing.add((method, template))
        return missing


# -- every route, sync and async -------------------------------------------------------------

def _every_route_sync(espn: Client) -> None:
    assert espn.health().status == "ok"
    ready = espn.ready()
    assert ready.ready and ready.mode == "read-write"
    assert "espn_" in espn.metrics()
    assert espn.limits() == models.ServerLimits(max_batch_queries=256, max_batch_writes=1000)

    found = espn.search(QUERY, k=3, filter=FILTER, return_text=True)
    assert len(found.results) == 3 and found.stats.matched and found.results[0].text
    explained = espn.search(QUERY, k=2, explain=True)
    assert all(hit.explanation is not None and hit.explanation.matches for hit in explained.results)
    batch = espn.search_batch([QUERY, "   ", "speed of light"], k=2)
    assert [r.index for r in batch.responses] == [0, 2] and [(e.index, e.error) for e in batch.errors] == [
        (1, "invalid_query")]
    many = espn.search_many([QUERY, "speed of light", "   ", "volcanoes", "photosynthesis"], k=2, chunk_size=2)
    assert [r.index for r in many.responses] == [0, 1, 3, 4] and [e.index for e in many.errors] == [2]
    assert [r.results for r in many.responses[:2]] == [r.results for r in batch.responses]  # the same queries

    document = espn.get_document("s0001")
    assert document.title == "The Sun" and document.metadata["topic"] == "astronomy"
    doc_id = "client sync/é 1"  # a space, a slash and a non-ASCII letter travel in the path
    created = espn.put_document(doc_id, "Tide pools hold anemones at low tide.", title="Tide pools",
                                metadata={"topic": "oceans", "year": 2021})
    assert created.created == [doc_id]
    assert espn.put_document(doc_id, "Tide pools hold sea stars.", metadata={"topic": "oceans"}).replaced == [doc_id]
    assert espn.get_document(doc_id).text == "Tide pools hold sea stars."
    assert espn.delete_document(doc_id).deleted == [doc_id]
    written = espn.write_documents(upsert=[{"id": "client-b1", "text": "Kelp forests grow in cold water."},
                                           models.DocumentUpsert(id="client-b2", text="Coral reefs bleach.")])
    assert sorted(written.created) == ["client-b1", "client-b2"]
    parts = espn.write_many(upsert=[{"id": f"client-m{i}", "text": f"Passage {i} about waves."} for i in range(3)],
                            delete=["client-b1", "client-b2"], chunk_size=2)
    # At most 2 upserts and 2 deletes a batch (the server's rule, per list), each batch a generation.
    assert [(len(p.created), len(p.deleted)) for p in parts] == [(2, 0), (1, 2)]
    assert parts[0].generation < parts[1].generation
    assert espn.get_documents(["client-m0", "client-b1"], missing_ok=True).keys() == {"client-m0"}
    espn.write_documents(delete=[f"client-m{i}" for i in range(3)])

    snapshot = espn.create_snapshot("client-sync")
    assert snapshot.name == "client-sync" and snapshot.generation >= 1
    assert "client-sync" in [s.name for s in espn.list_snapshots()]
    (index,) = espn.list_indexes()  # one index: the default, named `default`
    assert (index.name, index.default, index.open) == ("default", True, True)
    assert espn.get_index("default") == index
    refitting = espn.refit_index("default")  # a background rewrite: searches and writes go on
    assert refitting.name == "default" and refitting.fit is not None and refitting.generation is not None
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while (now := espn.get_index("default")).generation == refitting.generation or now.fit["refit_running"] is not None:
        assert time.monotonic() < deadline, f"the re-fit did not end: {now.fit}"
        time.sleep(0.2)
    assert now.documents == refitting.documents and now.fit["fitted_on_documents"] == now.documents
    # This server has no index root: creating and deleting are refused (tests/test_index_admin.py does both).
    for refused in (lambda: espn.create_index("new-one", "small"), lambda: espn.delete_index("default")):
        with pytest.raises(ConflictError) as error:
            refused()
        assert error.value.code == "admin_off"


async def _every_route_async(espn: AsyncClient) -> None:
    assert (await espn.health()).status == "ok"
    assert (await espn.ready()).ready
    assert "espn_" in await espn.metrics()
    found = await espn.search(QUERY, k=3, filter=FILTER)
    assert len(found.results) == 3 and found.stats.matched
    batch = await espn.search_batch([QUERY, "speed of light"], k=2, mode="dense")
    many = await espn.search_many([QUERY, "speed of light"], k=2, mode="dense", chunk_size=1)
    assert [r.results for r in many.responses] == [r.results for r in batch.responses]
    assert [r.index for r in many.responses] == [0, 1]
    assert (await espn.get_document("s0001")).title == "The Sun"
    assert (await espn.put_document("client-async", "Sea otters use tools.")).created == ["client-async"]
    assert (await espn.get_documents(["client-async", "s0001"])).keys() == {"client-async", "s0001"}
    assert (await espn.delete_document("client-async")).deleted == ["client-async"]
    assert (await espn.write_documents(upsert=[{"id": "client-async-b", "text": "Tsunamis."}])).created
    assert len(await espn.write_many(delete=["client-async-b"])) == 1
    assert (await espn.create_snapshot("client-async")).name == "client-async"
    assert "client-async" in [s.name for s in await espn.list_snapshots()]
    assert [i.name for i in await espn.list_indexes()] == ["default"]
    assert (await espn.get_index("default")).default
    with pytest.raises(NotFoundError):
        await espn.refit_index("no-such-index")
    with pytest.raises(ConflictError, match="index root"):
        await espn.create_index("new-one", "small")
    with pytest.raises(ConflictError, match="index root"):
        await espn.delete_index("default")
    assert (await espn.limits()).max_batch_queries == 256


def _every_index_route_sync(espn: Client) -> None:
    """The routes of one index under /v1/indexes/{name}/ (the client made with index=NAME)."""
    assert len(espn.search(QUERY, k=2).results) == 2
    assert [r.index for r in espn.search_batch([QUERY, "speed of light"], k=2).responses] == [0, 1]
    assert espn.get_document("s0001").title == "The Sun"
    assert espn.put_document("client-named", "Sea otters use tools.").created == ["client-named"]
    assert espn.delete_document("client-named").deleted == ["client-named"]
    assert espn.write_documents(upsert=[{"id": "client-named-b", "text": "Tsunamis."}]).created
    assert espn.write_documents(delete=["client-named-b"]).deleted == ["client-named-b"]
    assert espn.create_snapshot("client-named-sync").name == "client-named-sync"
    assert "client-named-sync" in [s.name for s in espn.list_snapshots()]


async def _every_index_route_async(espn: AsyncClient) -> None:
    assert len((await espn.search(QUERY, k=2)).results) == 2
    assert len((await espn.search_batch([QUERY], k=2)).responses) == 1
    assert (await espn.get_document("s0001")).title == "The Sun"
    assert (await espn.put_document("client-named-a", "Sea otters use tools.")).created == ["client-named-a"]
    assert (await espn.delete_document("client-named-a")).deleted == ["client-named-a"]
    assert (await espn.write_documents(delete=[], upsert=[{"id": "client-named-c", "text": "Tides."}])).created
    assert (await espn.write_documents(delete=["client-named-c"])).deleted == ["client-named-c"]
    assert (await espn.create_snapshot("client-named-async")).name == "client-named-async"
    assert "client-named-async" in [s.name for s in await espn.list_snapshots()]


def test_every_route_sync_and_async_covers_the_openapi_document(server, openapi) -> None:
    sync_sent, async_sent = Recorder(), Recorder()
    with httpx.Client(event_hooks={"request": [sync_sent.hook]}, timeout=HTTP_TIMEOUT_S) as http, \
            Client(server.base_url, api_key=CLIENT_API_KEY, http_client=http) as espn, \
            Client(server.base_url, api_key=CLIENT_API_KEY, http_client=http, index="default") as named:
        _every_route_sync(espn)
        _every_index_route_sync(named)

    async def run() -> None:
        async with httpx.AsyncClient(event_hooks={"request": [async_sent.ahook]},
                                     timeout=HTTP_TIMEOUT_S) as http:
            async with AsyncClient(server.base_url, api_key=CLIENT_API_KEY, http_client=http) as espn, \
                    AsyncClient(server.base_url, api_key=CLIENT_API_KEY, http_client=http, index="default") as named:
                await _every_route_async(espn)
                await _every_index_route_async(named)

    asyncio.run(run())
    assert not sync_sent.covered(openapi), "routes of /openapi.json the sync client did not reach"
    assert not async_sent.covered(openapi), "routes of /openapi.json the async client did not reach"


# -- the same answers as raw HTTP ------------------------------------------------------------

#: Stats that describe the work of one request (timings, what the prefetcher caught): they differ between two.
_PER_REQUEST = ("stage_ms", "queue_ms", "batch_size", "hit_rate", "bytes_read", "ios", "prefetched", "missed",
                "read_amplification")


def _same_answer(ours: Any, theirs: dict[str, Any]) -> None:
    """The client's model gives back the server's JSON: the same fields, results to the last bit,
    the same stats but the per-request ones, which are only present in both."""
    got = ours.model_dump(mode="json", exclude_unset=True)
    for mine, yours in zip(got.get("responses", [got]), theirs.get("responses", [theirs])):
        assert set(mine["stats"]) == set(yours["stats"])
        for name in _PER_REQUEST:
            mine["stats"].pop(name, None), yours["stats"].pop(name, None)
    assert got == theirs


def test_results_identical_to_raw_http(server, raw) -> None:
    body = {"query": QUERY, "k": 5, "filter": FILTER, "return_text": True, "explain": True}
    with Client(server.base_url, api_key=CLIENT_API_KEY, timeout=HTTP_TIMEOUT_S) as espn:
        _same_answer(espn.search(QUERY, k=5, filter=FILTER, return_text=True, explain=True),
                     raw.post("/v1/search", json=body).json())
        _same_answer(espn.search(QUERY, k=4, mode="hybrid", fusion="rrf"),
                     raw.post("/v1/search", json={"query": QUERY, "k": 4, "mode": "hybrid", "fusion": "rrf"}).json())
        batch = {"queries": [QUERY, "", "volcanoes"], "k": 3, "nprobe": 4}
        _same_answer(espn.search_batch([QUERY, "", "volcanoes"], k=3, nprobe=4),
                     raw.post("/v1/search/batch", json=batch).json())
        assert espn.get_document("s0002").model_dump(exclude_unset=True) == raw.get("/v1/documents/s0002").json()
        assert espn.ready().model_dump(exclude_unset=True) == raw.get("/readyz").json()

    async def run() -> models.SearchResponse:
        async with AsyncClient(server.base_url, api_key=CLIENT_API_KEY, timeout=HTTP_TIMEOUT_S) as espn:
            return await espn.search(QUERY, k=5, filter=FILTER, return_text=True, explain=True)

    _same_answer(asyncio.run(run()), raw.post("/v1/search", json=body).json())


# -- errors ------------------------------------------------------------------------------------

def test_error_answers_are_exceptions_with_the_servers_code_and_message(server, raw) -> None:
    with Client(server.base_url, api_key=CLIENT_API_KEY, timeout=HTTP_TIMEOUT_S) as espn:
        with pytest.raises(NotFoundError) as missing:
            espn.get_document("no-such-document")
        theirs = raw.get("/v1/documents/no-such-document").json()
        assert (missing.value.status_code, missing.value.code, missing.value.message) == (
            404, theirs["error"], theirs["message"]) and missing.value.code == "document_not_found"
        with pytest.raises(InvalidRequestError) as unknown_field:
            espn.search(QUERY, filter={"yeer": {"gte": 2010}})
        assert unknown_field.value.code == "invalid_parameter" and "yeer" in unknown_field.value.message
        with pytest.raises(InvalidRequestError) as bounds:
            espn.search(QUERY, k=0)
        assert bounds.value.code == "invalid_request" and bounds.value.errors and "k" in bounds.value.message
        with pytest.raises(ConflictError) as twice:
            espn.write_documents(upsert=[{"id": "x1", "text": "a"}, {"id": "x1", "text": "b"}])
        assert twice.value.code == "conflict"
        espn.create_snapshot("client-conflict")
        with pytest.raises(ConflictError):
            espn.create_snapshot("client-conflict")
        with pytest.raises(ValueError, match="nprobes"):  # a misspelled parameter never leaves the client
            espn.search(QUERY, nprobes=4)
        with pytest.raises(ValueError, match="twice"):
            espn.write_many(upsert=[{"id": "x2", "text": "a"}], delete=["x2"])
    with Client(server.base_url, api_key="wrong-key-0123456789", timeout=HTTP_TIMEOUT_S) as stranger:
        with pytest.raises(UnauthorizedError) as refused:
            stranger.search(QUERY)
        assert refused.value.code == "unauthorized"
        assert stranger.health().status == "ok"  # operations endpoints take no key

    async def run() -> None:
        async with AsyncClient(server.base_url, api_key=CLIENT_API_KEY, timeout=HTTP_TIMEOUT_S) as espn:
            with pytest.raises(NotFoundError, match="document_not_found"):
                await espn.delete_document("no-such-document")
            with pytest.raises(InvalidRequestError, match="invalid_parameter"):
                await espn.search_batch([QUERY], filter={"yeer": 1})
        async with AsyncClient(server.base_url, timeout=HTTP_TIMEOUT_S) as anonymous:
            with pytest.raises(UnauthorizedError):
                await anonymous.get_document("s0001")

    asyncio.run(run())


# -- retries, Retry-After and timeouts, against a loopback server that answers on cue -------------

_SEARCH_ANSWER = {"query": "q", "results": [{"id": "d1", "score": 1.0, "cls_score": 1.0, "bow_score": 1.0}],
                  "stats": {"stage_ms": {"total": 1.0}, "queue_ms": 0.0, "batch_size": 1, "hit_rate": 1.0,
                            "bytes_read": 0, "ios": 0, "prefetched": 0, "missed": 0}}


class Cue:
    """What the loopback server answers next: a list of (status, headers, body, delay_s); the
    last one repeats. Each request's (monotonic time, method, path, Authorization) is kept."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, dict[str, str], Any, float]] = []
        self.requests: list[tuple[float, str, str, str]] = []

    def set(self, *answers: tuple[int, dict[str, str], Any, float]) -> None:
        self.answers, self.requests = list(answers), []


@contextlib.contextmanager
def loopback(cue: Cue) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            cue.requests.append((time.monotonic(), self.command, self.path, self.headers.get("Authorization", "")))
            status, headers, body, delay = cue.answers.pop(0) if len(cue.answers) > 1 else cue.answers[0]
            time.sleep(delay)  # a slow answer, scripted by the test: not synchronisation
            payload = json.dumps(body).encode()
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", **headers}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = do_DELETE = _answer

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _unavailable(status: int, retry_after: str | None) -> tuple[int, dict[str, str], Any, float]:
    code = "overloaded" if status == 503 else "insufficient_storage"
    return (status, {"Retry-After": retry_after} if retry_after is not None else {},
            {"error": code, "message": f"{code}, try later"}, 0.0)


def test_retries_honour_retry_after_and_stop(tmp_path: Path) -> None:
    cue = Cue()
    ok = (200, {}, _SEARCH_ANSWER, 0.0)
    with loopback(cue) as url, Client(url, api_key="k-0123456789abcdef", index="tenant a",
                                                  timeout=HTTP_TIMEOUT_S) as espn:
        cue.set(_unavailable(503, "1"), _unavailable(507, "1"), ok)
        assert espn.search("q").results[0].id == "d1"
        times = [t for t, *_ in cue.requests]
        assert len(times) == 3 and times[1] - times[0] >= 0.95 and times[2] - times[1] >= 0.95
        # index="tenant a": the multi-index layout's routes; the key as a bearer token.
        assert {(m, p, a) for _, m, p, a in cue.requests} == {
            ("POST", "/v1/indexes/tenant%20a/search", "Bearer k-0123456789abcdef")}

        cue.set(_unavailable(503, "0"))  # never recovers: bounded attempts, then the server's error
        with pytest.raises(UnavailableError) as exhausted:
            espn.search("q")
        assert len(cue.requests) == RetryPolicy().attempts and exhausted.value.code == "overloaded"
        assert exhausted.value.retry_after_s == 0.0

        cue.set(_unavailable(507, "3600"), ok)  # a wait longer than max_retry_after_s is not waited for
        with pytest.raises(InsufficientStorageError):
            espn.put_document("d", "text")
        assert len(cue.requests) == 1

        cue.set((404, {}, {"error": "document_not_found", "message": "no document 'd'"}, 0.0), ok)  # not retried
        with pytest.raises(NotFoundError, match="no document 'd'"):
            espn.get_document("d")
        assert len(cue.requests) == 1

        cue.set((500, {}, "Internal Server Error", 0.0))  # not the server's error body: still an ApiError
        with pytest.raises(espn_client.ApiError) as plain:
            espn.health()
        assert plain.value.code == "http_500"
    with loopback(cue) as url, Client(url, retry=RetryPolicy(attempts=3, backoff_s=0.2),
                                                  timeout=HTTP_TIMEOUT_S) as espn:
        cue.set(_unavailable(503, None), _unavailable(503, None), ok)  # no Retry-After: exponential back-off
        espn.search("q")
        gaps = [b[0] - a[0] for a, b in zip(cue.requests, cue.requests[1:])]
        assert 0.2 <= gaps[0] < 0.4 and 0.4 <= gaps[1] < 0.7


def test_async_retries_and_timeouts() -> None:
    cue = Cue()

    async def run(url: str) -> None:
        async with AsyncClient(url, timeout=0.5) as espn:  # short on purpose: a stall of 1.5 s is tested
            cue.set(_unavailable(503, "1"), (200, {}, _SEARCH_ANSWER, 0.0))
            assert (await espn.search("q")).results[0].id == "d1"
            assert len(cue.requests) == 2 and cue.requests[1][0] - cue.requests[0][0] >= 0.95
            cue.set((200, {}, _SEARCH_ANSWER, 1.5))
            with pytest.raises(RequestTimeoutError):
                await espn.search("q")

    with loopback(cue) as url:
        asyncio.run(run(url))
        cue.set((200, {}, _SEARCH_ANSWER, 1.5))
        with Client(url, timeout=0.5) as espn, pytest.raises(RequestTimeoutError):  # short on purpose, as above
            espn.search("q")
    with Client(url, retry=RetryPolicy(attempts=2, backoff_s=0.01), timeout=HTTP_TIMEOUT_S) as gone, \
            pytest.raises(espn_client.TransportError):
        gone.health()  # the loopback server is closed: nothing listens


def test_a_transport_that_hands_over_the_body_already_read() -> None:
    """httpx.MockTransport (what applications' own tests plug in) reads each body itself: the
    client takes it as it is, under the same cap (a user's transport, not a stand-in for the server)."""
    body = json.dumps(_SEARCH_ANSWER).encode()
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    with httpx.Client(transport=transport) as http, Client("http://espn.test", http_client=http) as espn:
        assert espn.search("q").results[0].id == "d1"
    with httpx.Client(transport=transport) as http, Client("http://espn.test", http_client=http,
                                                            max_answer_bytes=100) as espn:
        with pytest.raises(espn_client.ResponseTooLargeError):
            espn.search("q")

    async def run() -> None:
        async with httpx.AsyncClient(transport=transport) as http, \
                AsyncClient("http://espn.test", http_client=http) as espn:
            assert (await espn.search("q")).results[0].id == "d1"

    asyncio.run(run())


# -- packaging ---------------------------------------------------------------------------------

def test_importing_the_client_imports_no_framework_and_nothing_of_espn() -> None:
    code = ("import sys, espn_client, espn_client.models\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'espn', 'torch', 'faiss', 'numpy', 'langchain_core', 'llama_index', 'haystack'})\n"
            "assert not heavy, heavy\n"
            "sys.modules['langchain_core'] = None\n"
            "try:\n    import espn_client.langchain\nexcept ImportError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "pip install 'espn-client[langchain]'" in done.stdout


def test_the_client_distribution_depends_on_httpx_and_pydantic_only() -> None:
    project = tomllib.loads((ROOT / "clients" / "python" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "espn-client"
    assert sorted(re.split(r"[<>=!~ ]", d)[0] for d in project["dependencies"]) == ["httpx", "pydantic"]
    assert {"langchain", "llama-index", "haystack"} <= set(project["optional-dependencies"])


def test_bench_client_quick(server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from benchmarks import bench_client, common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    # The machine's description without importing torch and FAISS (seconds), which it reports otherwise.
    monkeypatch.setattr(bench_client, "machine", lambda: {"cpus": os.cpu_count(), "loadavg": os.getloadavg(),
                                                          "time": "now"})
    assert bench_client.main(["--url", server.base_url, "--api-key", CLIENT_API_KEY, "--quick"]) == 0
    assert "|---" in capsys.readouterr().out
    payload = json.loads((tmp_path / "client_overhead.json").read_text())
    assert set(payload["p50_ms"]) == {"httpx", "Client", "httpx async", "AsyncClient"}
