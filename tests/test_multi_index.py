"""Several named indexes in one server (`espn serve --index NAME=PATH`, issue 48 part 1).

One module-scoped server holds two copies of the sample index, `a` (the default) and `b`,
given as a directory of indexes, with an API key and a short idle close; one restart at the
end. Checked: the list of indexes, searches of both (and of the default's old routes), a
write to one never in the other, the key on every index route, unknown names, per-index
readiness and metrics, one encoder for both, idle close and reopen, a restart keeping both.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from starlette.testclient import TestClient

from espn_server.router.app import build_router_app
from espn_server.index_names import resolve_indexes
from espn_server.router_settings import RouterSettings
from helpers import HTTP_TIMEOUT_S
from server_fixtures import HTTP, ServerProcess, running_server

KEY = "multi-index-test-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
IDLE_S = 1.5
#: Served under `ulimit -n` of this (as tests/test_live_server.py): an index opened and closed
#: again and again must give its descriptors back.
FD_LIMIT = 256
QUERY = {"query": "the speed of light in a vacuum", "k": 5}


@pytest.fixture(scope="module")
def root(sample_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("multi-index")
    for name in ("a", "b"):
        shutil.copytree(sample_index, root / "indexes" / name)
    return root


def _serve(root: Path, name: str) -> Any:
    return running_server(root / "indexes" / "a", root, "--index", str(root / "indexes"), "--index-idle-close",
                          str(IDLE_S), "--snapshot-dir", str(root / "snapshots"), env={"ESPN_API_KEY": KEY},
                          name=name, fd_limit=FD_LIMIT)


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerProcess]:
    with _serve(root, "multi") as server:
        yield server


def _get(server: ServerProcess, path: str, **kwargs: Any) -> httpx.Response:
    return HTTP.get(server.base_url + path, headers=AUTH, timeout=60, **kwargs)


def _post(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    return HTTP.post(server.base_url + path, json=body, headers=AUTH, timeout=60)


def _ids(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [hit["id"] for hit in response.json()["results"]]


def _indexes(server: ServerProcess) -> dict[str, dict[str, Any]]:
    response = _get(server, "/v1/indexes")
    assert response.status_code == 200, response.text
    return {item["name"]: item for item in response.json()["indexes"]}


def test_the_settings_name_every_index(root: Path) -> None:
    a, b = root / "indexes" / "a", root / "indexes" / "b"
    assert resolve_indexes(a, [str(root / "indexes")]) == {"a": a, "b": b}  # the default first, named by its entry
    assert resolve_indexes(b, [f"x={a}"]) == {"default": b, "x": a}
    assert resolve_indexes(None, [str(a)]) == {"default": a}  # a plain --index PATH: the default index
    with pytest.raises(ValueError, match="given twice"):
        resolve_indexes(None, [f"x={a}", f"x={b}"])
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        resolve_indexes(None, [f"{root}/no-such"])


def test_both_indexes_are_listed_and_searched(server: ServerProcess) -> None:
    listed = _indexes(server)
    assert list(listed) == ["a", "b"] and listed["a"]["default"] and not listed["b"]["default"]
    assert listed["b"]["encoder"] == listed["a"]["encoder"] and listed["a"]["documents"] == 300
    default = _ids(_post(server, "/v1/search", QUERY))
    assert _ids(_post(server, "/v1/indexes/a/search", QUERY)) == default
    assert _ids(_post(server, "/v1/indexes/b/search", QUERY)) == default  # a copy: the same ranking
    batch = _post(server, "/v1/indexes/b/search/batch", {"queries": [QUERY["query"]], "k": 5})
    assert [h["id"] for h in batch.json()["responses"][0]["results"]] == default
    assert _get(server, "/v1/indexes/b/documents/s0001").json()["title"] == "The Sun"
    assert _get(server, "/v1/indexes/b").json()["name"] == "b"
    # One query encoder for both indexes in the worker (same manifest entry, same model files).
    assert "encoder shared" in server.log() and server.log().count('"encoder loaded"') == 1


def test_a_write_to_one_index_never_appears_in_the_other(server: ServerProcess) -> None:
    doc = {"text": "Narwhals sing in the arctic polar night about zebra quantum tides.", "title": "Narwhals"}
    response = HTTP.put(f"{server.base_url}/v1/indexes/b/documents/only-in-b", json=doc, headers=AUTH, timeout=60)
    assert response.status_code == 201, response.text
    query = {"query": "narwhals sing in the arctic polar night", "k": 3}
    assert _ids(_post(server, "/v1/indexes/b/search", query))[0] == "only-in-b"
    assert "only-in-b" not in _ids(_post(server, "/v1/indexes/a/search", query))
    assert "only-in-b" not in _ids(_post(server, "/v1/search", query))
    for path in ("/v1/indexes/a/documents/only-in-b", "/v1/documents/only-in-b"):
        assert _get(server, path).status_code == 404
    batch = _post(server, "/v1/documents/batch", {"upsert": [{"id": "only-in-a", "text": "A passage of a."}]})
    assert batch.status_code == 200, batch.text
    assert _get(server, "/v1/indexes/b/documents/only-in-a").status_code == 404
    assert _get(server, "/v1/indexes/a/documents/only-in-a").status_code == 200


def test_the_api_key_guards_every_index_route(server: ServerProcess) -> None:
    for method, path in [("GET", "/v1/indexes"), ("GET", "/v1/indexes/b"), ("POST", "/v1/indexes/b/search"),
                         ("GET", "/v1/indexes/b/documents/s0001"), ("DELETE", "/v1/indexes/b/documents/s0001"),
                         ("POST", "/v1/indexes/nope/search"), ("GET", "/v1/indexes/b/snapshots")]:
        response = HTTP.request(method, server.base_url + path, json=QUERY)
        assert response.status_code == 401 and response.json()["error"] == "unauthorized", (method, path)
    assert _get(server, "/v1/indexes/b/documents/s0001").status_code == 200  # not deleted


def test_an_unknown_index_is_a_404(server: ServerProcess) -> None:
    for response in (_post(server, "/v1/indexes/nope/search", QUERY), _get(server, "/v1/indexes/nope"),
                     _get(server, "/v1/indexes/nope/documents/s0001")):
        assert response.status_code == 404 and response.json()["error"] == "not_found", response.text
        assert "nope" in response.json()["message"]
    not_a_route = _get(server, "/v1/indexes/b/healthz")
    assert not_a_route.status_code == 404 and not_a_route.json()["error"] == "not_found"


def test_readiness_and_metrics_report_each_index(server: ServerProcess) -> None:
    _post(server, "/v1/indexes/b/search", QUERY)
    ready = _get(server, "/readyz").json()  # with the key: without it, ready or not only
    assert [item["name"] for item in ready["indexes"]] == ["a", "b"]
    metrics = HTTP.get(server.base_url + "/metrics").text
    assert 'espn_index_requests_total{index="b"}' in metrics and 'espn_index_open{index="a"} 1.0' in metrics
    assert 'endpoint="/v1/indexes/{index}/search"' in metrics


def _open_descriptors(server: ServerProcess) -> int:
    """Descriptors of `espn serve` and its workers."""
    import psutil

    process = psutil.Process(server.pid)
    return sum(p.num_fds() for p in [process, *process.children(recursive=True)])


def _wait_closed(server: ServerProcess, name: str) -> None:
    deadline = time.monotonic() + 30
    while _indexes(server)[name]["open"]:
        assert time.monotonic() < deadline, f"index {name} did not close when idle"
        time.sleep(0.3)


def test_an_idle_index_closes_and_reopens_with_the_same_answers(server: ServerProcess) -> None:
    before = _ids(_post(server, "/v1/indexes/b/search", QUERY))
    _wait_closed(server, "b")
    assert _indexes(server)["a"]["open"]  # the default index stays open
    assert _ids(_post(server, "/v1/indexes/b/search", QUERY)) == before
    assert _indexes(server)["b"]["open"]
    found = _get(server, "/v1/indexes/b/documents/only-in-b")
    assert found.status_code == 200, found.text
    # Closed and reopened again and again under the descriptor limit: nothing is left open.
    _wait_closed(server, "b")
    closed = _open_descriptors(server)
    for _ in range(3):
        assert _ids(_post(server, "/v1/indexes/b/search", QUERY)) == before
        _wait_closed(server, "b")
    assert _open_descriptors(server) <= closed + 2, (closed, _open_descriptors(server))


def test_snapshots_are_per_index(server: ServerProcess, root: Path) -> None:
    taken = _post(server, "/v1/indexes/b/snapshots", {"name": "b-snap"})
    assert taken.status_code == 201, taken.text
    assert (root / "snapshots" / "b" / "b-snap").is_dir()
    assert "b-snap" in [s["name"] for s in _get(server, "/v1/indexes/b/snapshots").json()["snapshots"]]
    assert "b-snap" not in [s["name"] for s in _get(server, "/v1/snapshots").json()["snapshots"]]


def test_the_router_forwards_per_index(server: ServerProcess) -> None:
    settings = RouterSettings(shards=[server.base_url], writers=[server.base_url], timeout_ms=HTTP_TIMEOUT_S * 1000)
    with TestClient(build_router_app(settings)) as router:
        direct = _ids(_post(server, "/v1/indexes/b/search", QUERY))
        routed = router.post("/v1/indexes/b/search", json=QUERY, headers=AUTH)
        assert routed.status_code == 200, routed.text
        assert [hit["id"] for hit in routed.json()["results"]] == direct
        written = router.put("/v1/indexes/b/documents/via-router", json={"text": "Routed to b only."}, headers=AUTH)
        assert written.status_code == 201, written.text
        assert router.get("/v1/indexes/b/documents/via-router", headers=AUTH).status_code == 200
        assert router.get("/v1/indexes/a/documents/via-router", headers=AUTH).status_code == 404
        unknown = router.post("/v1/indexes/nope/search", json=QUERY, headers=AUTH)
        assert unknown.status_code == 404 and unknown.json()["error"] == "not_found"
    assert _get(server, "/v1/indexes/b/documents/via-router").status_code == 200
    assert _get(server, "/v1/documents/via-router").status_code == 404


def test_a_restart_keeps_both_indexes(server: ServerProcess, root: Path) -> None:
    server.terminate()
    with _serve(root, "multi-restarted") as again:
        assert list(_indexes(again)) == ["a", "b"]
        found = _get(again, "/v1/indexes/b/documents/only-in-b")
        assert found.status_code == 200, found.text
        assert _get(again, "/v1/indexes/a/documents/only-in-b").status_code == 404
        assert _get(again, "/v1/documents/only-in-a").status_code == 200
        assert _get(again, "/v1/indexes/b/documents/only-in-a").status_code == 404
