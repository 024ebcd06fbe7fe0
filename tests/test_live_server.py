"""Writes over HTTP against a real `espn serve --workers 2` on a copy of the sample index."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from espn.segments import read_current
from server_fixtures import running_server

API_KEY = "live-index-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def live_server(sample_index: Path, tmp_path_factory: pytest.TempPathFactory):
    index = tmp_path_factory.mktemp("live") / "index"
    shutil.copytree(sample_index, index)
    with running_server(index, tmp_path_factory.mktemp("logs"), "--workers", "2",
                        env={"ESPN_API_KEY": API_KEY, "ESPN_COMPACT_MAX_SEGMENTS": "3"}, name="live") as server:
        server.index = index
        yield server


def _search_everywhere(server, query: str, times: int = 6) -> list[list[str]]:
    """The top ids from `times` fresh connections (so both workers answer)."""
    out = []
    for _ in range(times):
        response = httpx.post(f"{server.base_url}/v1/search", json={"query": query, "k": 5}, headers=AUTH, timeout=60)
        assert response.status_code == 200, response.text
        out.append([hit["id"] for hit in response.json()["results"]])
    return out


def test_put_replace_delete_are_visible_in_every_worker(live_server) -> None:
    url = f"{live_server.base_url}/v1/documents"
    body = {"title": "Elephants", "text": "A purple elephant is dancing on the moon tonight.", "metadata": {"year": 2026}}
    assert httpx.put(f"{url}/http-1", json=body, timeout=60).status_code == 401  # writes need the key
    created = httpx.put(f"{url}/http-1", json=body, headers=AUTH, timeout=120)
    assert created.status_code == 201, created.text
    assert created.json()["created"] == ["http-1"]
    assert all(ids[0] == "http-1" for ids in _search_everywhere(live_server, "purple elephant dancing on the moon"))
    replaced = httpx.put(f"{url}/http-1", json={"text": "Fresh basil and tomatoes for a pasta sauce."}, headers=AUTH,
                         timeout=120)
    assert replaced.status_code == 200 and replaced.json()["replaced"] == ["http-1"]
    assert httpx.get(f"{url}/http-1", headers=AUTH).json()["text"].startswith("Fresh basil")
    for ids in _search_everywhere(live_server, "purple elephant dancing on the moon"):
        assert "http-1" not in ids  # the old version is gone everywhere
    deleted = httpx.delete(f"{url}/http-1", headers=AUTH, timeout=60)
    assert deleted.status_code == 200 and deleted.json()["deleted"] == ["http-1"]
    again = httpx.delete(f"{url}/http-1", headers=AUTH, timeout=60)
    assert again.status_code == 404 and again.json()["error"] == "document_not_found"
    assert httpx.get(f"{url}/http-1", headers=AUTH).status_code == 404
    for ids in _search_everywhere(live_server, "basil tomatoes pasta sauce"):
        assert "http-1" not in ids


def test_batch_is_one_generation(live_server) -> None:
    before = read_current(live_server.index).number
    response = httpx.post(f"{live_server.base_url}/v1/documents/batch", headers=AUTH, timeout=120, json={
        "upsert": [{"id": "b-1", "text": "Glaciers carve deep valleys over thousands of years."},
                   {"id": "b-2", "title": "Volcano", "text": "Lava flows from an erupting volcano."}],
        "delete": ["s0010"]})
    assert response.status_code == 200, response.text
    assert response.json()["created"] == ["b-1", "b-2"] and response.json()["deleted"] == ["s0010"]
    assert response.json()["generation"] >= before + 1  # +1, or more after a background compaction
    assert httpx.get(f"{live_server.base_url}/v1/documents/s0010", headers=AUTH).status_code == 404
    assert all(ids[0] == "b-2" for ids in _search_everywhere(live_server, "erupting volcano lava", times=4))


@pytest.mark.parametrize("method, path, body, status", [
    ("PUT", "/v1/documents/x-1", b'{"text": ', 400),                                   # malformed JSON
    ("PUT", "/v1/documents/x-1", {"title": "no text"}, 422),                           # text missing
    ("PUT", "/v1/documents/x-1", {"text": ""}, 422),                                   # empty text
    ("PUT", "/v1/documents/x-1", {"text": "ok", "colour": "red"}, 422),                # unknown field
    ("PUT", "/v1/documents/x-1", {"text": "x" * 100_001}, 422),                        # oversize text
    ("PUT", "/v1/documents/x-1", {"text": "ok", "metadata": [1, 2]}, 422),             # metadata not an object
    ("PUT", "/v1/documents/x-1", {"text": "y" * 2_000_000}, 413),                      # over the body limit
    ("DELETE", "/v1/documents/no-such-id", None, 404),
    ("POST", "/v1/documents/batch", {"upsert": [{"id": "x-1", "text": "ok"}], "delete": ["no-such-id"]}, 404),
    ("PUT", "/v1/documents/x-1", {"title": "t" * 10_001, "text": "ok"}, 422),         # oversize title
    ("PUT", "/v1/documents/x-1", {"text": "   "}, 422),                                # blank text
    ("PUT", "/v1/documents/%20x-1", {"text": "ok"}, 422),                              # id with a leading space
    ("PUT", "/v1/documents/x-1", {"text": "ok", "metadata": {"year": "x"}}, 409),      # year is an integer field
    ("POST", "/v1/documents/batch", {"upsert": [{"id": "x-1", "text": "a"}, {"id": "x-1", "text": "b"}]}, 409),
    ("POST", "/v1/documents/batch", {"upsert": [{"id": "x-1", "text": "a"}], "delete": ["x-1"]}, 409),
    ("POST", "/v1/documents/batch", {"delete": []}, 422),
    ("GET", "/v1/documents/batch", None, 405),
    ("POST", "/v1/documents/batch", {}, 422),
])
def test_bad_writes_are_4xx_and_write_nothing(live_server, method: str, path: str, body, status: int) -> None:
    before = read_current(live_server.index)
    kwargs = {"content": body, "headers": {**AUTH, "Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": AUTH} if body is not None else {"headers": AUTH}
    response = httpx.request(method, f"{live_server.base_url}{path}", timeout=60, **kwargs)
    assert response.status_code == status, response.text
    assert response.json()["message"]
    if status == 405:
        assert response.headers["allow"] == "POST"
    assert read_current(live_server.index) == before
    assert httpx.get(f"{live_server.base_url}/v1/documents/x-1", headers=AUTH).status_code == 404


def test_background_compaction_past_the_threshold(live_server) -> None:
    """ESPN_COMPACT_MAX_SEGMENTS=3: the fourth delta triggers a compaction in the background."""
    for i in range(4):
        response = httpx.put(f"{live_server.base_url}/v1/documents/c-{i}", json={"text": f"compaction probe {i}"},
                             headers=AUTH, timeout=120)
        assert response.status_code in (200, 201, 503), response.text
    import time

    deadline = time.monotonic() + 60
    while len(read_current(live_server.index).segments) > 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    current = read_current(live_server.index)
    assert len(current.segments) <= 3 and current.base != "."
    assert httpx.get(f"{live_server.base_url}/v1/documents/c-0", headers=AUTH).status_code == 200
    assert httpx.get(f"{live_server.base_url}/v1/documents/s0010", headers=AUTH).status_code == 404
