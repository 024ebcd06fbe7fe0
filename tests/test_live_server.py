"""Writes over HTTP against a real `espn serve --workers 2` on a copy of the sample index,
started under `ulimit -n 256` so that a descriptor leak fails loudly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from urllib.parse import quote

import pytest
from helpers import run_threads, wait_until

from espn.generation.format import read_current
from espn.ids import MAX_ID_BYTES, id_problem
from server_fixtures import HTTP, running_server

API_KEY = "live-index-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FD_LIMIT = 256


@pytest.fixture(scope="module")
def live_server(sample_index: Path, tmp_path_factory: pytest.TempPathFactory):
    index = tmp_path_factory.mktemp("live") / "index"
    shutil.copytree(sample_index, index)
    env = {"ESPN_API_KEY": API_KEY, "ESPN_COMPACT_MAX_SEGMENTS": "3", "ESPN_COMPACT_MERGE_FACTOR": "3",
           "ESPN_MAX_INDEX_FIELDS": "5"}  # the sample corpus has topic, year and tags
    with running_server(index, tmp_path_factory.mktemp("logs"), "--workers", "2", env=env, name="live",
                        fd_limit=FD_LIMIT) as server:
        server.index = index
        yield server


def _worker_fds(server) -> dict[int, int]:
    """Open descriptors of each worker process (the children of `espn serve`)."""
    import psutil

    return {child.pid: child.num_fds() for child in psutil.Process(server.pid).children()}


def _search_everywhere(server, query: str, times: int = 6) -> list[list[str]]:
    """The top ids from `times` fresh connections (so both workers answer)."""
    out = []
    for _ in range(times):
        response = HTTP.post(f"{server.base_url}/v1/search", json={"query": query, "k": 5}, headers=AUTH, timeout=60)
        assert response.status_code == 200, response.text
        out.append([hit["id"] for hit in response.json()["results"]])
    return out


def test_every_worker_warms_its_write_path_before_it_is_ready(live_server) -> None:
    """The write path's encoder loads before /readyz says ready, in each worker: loaded by the
    first write instead, it cost that write 4 s on an idle machine and past 10 s on CI."""
    def logged() -> list[str]:
        messages = [json.loads(line).get("msg") for line in live_server.log().splitlines() if line.startswith('{"ts"')]
        return [m for m in messages if m in ("write path warmed", "ready")]

    # /readyz answered once the first worker was ready; the other may still warm.
    wait_until(lambda: logged().count("ready") == 2, lambda: f"both workers to be ready: {logged()}", timeout_s=120,
               interval_s=0.2)
    events = logged()
    assert events.count("ready") == 2 and events.count("write path warmed") == 2, events
    for n in (1, 2):  # the n-th worker to be ready had warmed its write path before
        assert events[:_nth_index(events, "ready", n)].count("write path warmed") >= n, events


def _nth_index(items: list, value: object, n: int) -> int:
    return [i for i, item in enumerate(items) if item == value][n - 1]


def test_put_replace_delete_are_visible_in_every_worker(live_server) -> None:
    url = f"{live_server.base_url}/v1/documents"
    body = {"title": "Elephants", "text": "A purple elephant is dancing on the moon tonight.", "metadata": {"year": 2026}}
    assert HTTP.put(f"{url}/http-1", json=body, timeout=60).status_code == 401  # writes need the key
    created = HTTP.put(f"{url}/http-1", json=body, headers=AUTH, timeout=120)
    assert created.status_code == 201, created.text
    assert created.json()["created"] == ["http-1"]
    # A read gives back what was written, metadata included; a replace without metadata has none.
    assert HTTP.get(f"{url}/http-1", headers=AUTH).json() == {"id": "http-1", **body}
    assert all(ids[0] == "http-1" for ids in _search_everywhere(live_server, "purple elephant dancing on the moon"))
    replaced = HTTP.put(f"{url}/http-1", json={"text": "Fresh basil and tomatoes for a pasta sauce."}, headers=AUTH,
                         timeout=120)
    assert replaced.status_code == 200 and replaced.json()["replaced"] == ["http-1"]
    assert HTTP.get(f"{url}/http-1", headers=AUTH).json()["text"].startswith("Fresh basil")
    assert HTTP.get(f"{url}/http-1", headers=AUTH).json()["metadata"] == {}
    for ids in _search_everywhere(live_server, "purple elephant dancing on the moon"):
        assert "http-1" not in ids  # the old version is gone everywhere
    deleted = HTTP.delete(f"{url}/http-1", headers=AUTH, timeout=60)
    assert deleted.status_code == 200 and deleted.json()["deleted"] == ["http-1"]
    again = HTTP.delete(f"{url}/http-1", headers=AUTH, timeout=60)
    assert again.status_code == 404 and again.json()["error"] == "document_not_found"
    assert HTTP.get(f"{url}/http-1", headers=AUTH).status_code == 404
    for ids in _search_everywhere(live_server, "basil tomatoes pasta sauce"):
        assert "http-1" not in ids


def test_batch_is_one_generation(live_server) -> None:
    before = read_current(live_server.index).number
    response = HTTP.post(f"{live_server.base_url}/v1/documents/batch", headers=AUTH, timeout=120, json={
        "upsert": [{"id": "b-1", "text": "Glaciers carve deep valleys over thousands of years."},
                   {"id": "b-2", "title": "Volcano", "text": "Lava flows from an erupting volcano."}],
        "delete": ["s0010"]})
    assert response.status_code == 200, response.text
    assert response.json()["created"] == ["b-1", "b-2"] and response.json()["deleted"] == ["s0010"]
    assert response.json()["generation"] >= before + 1  # +1, or more after a background compaction
    # New documents through a batch are a 200 (not PUT's 201): the body says which were created.
    assert response.json()["replaced"] == []
    assert HTTP.get(f"{live_server.base_url}/v1/documents/s0010", headers=AUTH).status_code == 404
    assert all(ids[0] == "b-2" for ids in _search_everywhere(live_server, "erupting volcano lava", times=4))


@pytest.mark.parametrize("method, path, body, status", [
    ("PUT", "/v1/documents/x-1", b'{"text": ', 400),                                   # malformed JSON
    ("PUT", "/v1/documents/x-1", {"title": "no text"}, 422),                           # text missing
    ("PUT", "/v1/documents/x-1", {"text": ""}, 422),                                   # empty text
    ("PUT", "/v1/documents/x-1", {"text": "ok", "colour": "red"}, 422),                # unknown field
    ("PUT", "/v1/documents/x-1", {"text": "x" * 100_001}, 422),                        # oversize text
    ("PUT", "/v1/documents/x-1", {"text": "ok", "metadata": [1, 2]}, 422),             # metadata not an object
    ("PUT", "/v1/documents/x-1", {"text": "ok", "metadata": {f"f{i}": i for i in range(65)}}, 422),  # fields
    ("PUT", "/v1/documents/x-1", {"text": "ok", "metadata": {"tags": ["t" * 200] * 100}}, 422),      # bytes
    ("PUT", "/v1/documents/x-1", {"text": "ok", "metadata": {"n": {"e": {"s": 1}}}}, 422),           # nesting
    ("PUT", "/v1/documents/x-1", {"text": "ok", "metadata": {"a1": 1, "a2": 2, "a3": 3}}, 422),      # index fields
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
    before = read_current(live_server.index).live_documents  # compaction may publish meanwhile
    kwargs = {"content": body, "headers": {**AUTH, "Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": AUTH} if body is not None else {"headers": AUTH}
    response = HTTP.request(method, f"{live_server.base_url}{path}", timeout=60, **kwargs)
    assert response.status_code == status, response.text
    assert response.json()["message"]
    if status == 405:
        assert response.headers["allow"] == "POST"
    assert read_current(live_server.index).live_documents == before
    assert HTTP.get(f"{live_server.base_url}/v1/documents/x-1", headers=AUTH).status_code == 404


@pytest.mark.parametrize("raw_id, problem", [
    ("s0005%00", "control character U+0000"),      # was stored as "s0005" and replaced it
    ("new%01id", "control character U+0001"),
    ("bad%FF", "not valid UTF-8"),                  # was stored with U+FFFD
    ("sur%ED%A0%80", "lone surrogate U+D800"),
    ("%20padded", "whitespace"),
])
def test_ids_are_exact_bytes_or_refused(live_server, raw_id: str, problem: str) -> None:
    before = read_current(live_server.index).live_documents  # compaction may publish meanwhile
    url = f"{live_server.base_url}/v1/documents/{raw_id}"
    for method, body in [("PUT", {"text": "an id the index must not store"}), ("DELETE", None), ("GET", None)]:
        response = HTTP.request(method, url, json=body, headers=AUTH, timeout=60)
        assert response.status_code == 422, (method, response.text)
        assert problem in response.json()["message"]
    batch = HTTP.post(f"{live_server.base_url}/v1/documents/batch", headers=AUTH, timeout=60, json={
        "upsert": [{"id": "fine", "text": "a fine document"}], "delete": ["s0005\x00"]})
    assert batch.status_code == 422 and "U+0000" in batch.json()["message"]
    assert read_current(live_server.index).live_documents == before
    assert HTTP.get(f"{live_server.base_url}/v1/documents/s0005", headers=AUTH).json()["id"] == "s0005"


def test_ids_differing_only_in_normalisation_are_different_documents(live_server) -> None:
    url = f"{live_server.base_url}/v1/documents"
    composed, decomposed = "caf%C3%A9", "cafe%CC%81"  # "café" as NFC and as NFD
    assert HTTP.put(f"{url}/{composed}", json={"text": "composed"}, headers=AUTH, timeout=120).status_code == 201
    assert HTTP.put(f"{url}/{decomposed}", json={"text": "decomposed"}, headers=AUTH, timeout=120).status_code == 201
    assert HTTP.get(f"{url}/{composed}", headers=AUTH).json()["text"] == "composed"
    assert HTTP.get(f"{url}/{decomposed}", headers=AUTH).json()["text"] == "decomposed"


def test_every_id_the_library_takes_is_written_over_http(live_server) -> None:
    """One id limit for `espn add` and HTTP: espn.ids.MAX_ID_BYTES UTF-8 bytes, refused in the library's words."""
    url = f"{live_server.base_url}/v1/documents"
    for doc_id in ("i" * MAX_ID_BYTES, "é" * (MAX_ID_BYTES // 2)):  # 512 bytes of 1-byte and of 2-byte characters
        assert id_problem(doc_id) is None
        response = HTTP.put(f"{url}/{quote(doc_id)}", json={"text": "the longest id"}, headers=AUTH, timeout=120)
        assert response.status_code == 201, response.text
        assert HTTP.get(f"{url}/{quote(doc_id)}", headers=AUTH, timeout=60).json()["id"] == doc_id
    # Background compaction may publish a generation meanwhile; it never changes the live documents.
    before = read_current(live_server.index).live_documents
    for doc_id in ("i" * (MAX_ID_BYTES + 1), "é" * (MAX_ID_BYTES // 2 + 1)):
        said = id_problem(doc_id)
        assert said is not None and "UTF-8 bytes long" in said
        put = HTTP.put(f"{url}/{quote(doc_id)}", json={"text": "too long an id"}, headers=AUTH, timeout=60)
        batch = HTTP.post(f"{url}/batch", json={"upsert": [{"id": doc_id, "text": "too long an id"}]}, headers=AUTH,
                          timeout=60)
        for response in (put, batch):
            assert response.status_code == 422 and said in response.json()["message"], response.text
    assert read_current(live_server.index).live_documents == before


def test_concurrent_writes_are_published_together(live_server) -> None:
    """12 writers at once: every write answered after it is visible in both workers, in fewer
    generations than writes (those that arrive while one publishes share the next)."""
    before = read_current(live_server.index).number
    answers: dict[int, dict] = {}

    def write(i: int) -> None:
        response = HTTP.put(f"{live_server.base_url}/v1/documents/group-{i}", headers=AUTH, timeout=120,
                             json={"text": f"group commit probe {i}: a zebra playing chess number {i}"})
        assert response.status_code == 201, response.text
        answers[i] = response.json()
        # Any request after the answer sees the write, in whichever worker it lands.
        for _ in range(2):
            got = HTTP.get(f"{live_server.base_url}/v1/documents/group-{i}", headers=AUTH, timeout=60)
            assert got.status_code == 200, got.text

    run_threads(write, n=12)
    generations = {a["generation"] for a in answers.values()}
    assert len(generations) < 12 and max(generations) <= read_current(live_server.index).number
    assert min(generations) > before


def test_descriptors_stay_flat_over_many_writes(live_server) -> None:
    """Under `ulimit -n 256`: 30 writes, every one answered, and no worker holds more descriptors
    after them than before (plus a few for connections)."""
    url = f"{live_server.base_url}/v1/documents"
    HTTP.put(f"{url}/fd-warm", json={"text": "warm both workers' writers"}, headers=AUTH, timeout=120)
    _search_everywhere(live_server, "warm up", times=4)
    before = _worker_fds(live_server)
    for i in range(15):
        put = HTTP.put(f"{url}/fd-{i}", json={"text": f"descriptor probe {i}", "metadata": {"year": i}},
                        headers=AUTH, timeout=120)
        assert put.status_code == 201, put.text
        delete = HTTP.delete(f"{url}/fd-{i}", headers=AUTH, timeout=120)
        assert delete.status_code == 200, delete.text
    _search_everywhere(live_server, "descriptor probe", times=4)
    after = _worker_fds(live_server)
    assert after.keys() == before.keys()
    for pid, count in after.items():
        assert count <= before[pid] + 16, (before, after)


def test_background_compaction_merges_deltas(live_server) -> None:
    """ESPN_COMPACT_MAX_SEGMENTS=3: past three deltas, three are merged into one in the background,
    keeping every document and dropping nothing that is live."""
    for i in range(4):
        response = HTTP.put(f"{live_server.base_url}/v1/documents/c-{i}", json={"text": f"compaction probe {i}"},
                             headers=AUTH, timeout=120)
        assert response.status_code in (200, 201), response.text
    wait_until(lambda: len(read_current(live_server.index).segments) <= 3, "the background compaction",
               timeout_s=60, interval_s=0.5)
    current = read_current(live_server.index)
    assert len(current.segments) <= 3 and any(s.documents > 1 for s in current.segments)
    for i in range(4):
        assert HTTP.get(f"{live_server.base_url}/v1/documents/c-{i}", headers=AUTH).status_code == 200
    deleted = HTTP.get(f"{live_server.base_url}/v1/documents/s0010", headers=AUTH)
    assert deleted.status_code == 404, (deleted.text, read_current(live_server.index))
    assert "Traceback" not in live_server.log()
