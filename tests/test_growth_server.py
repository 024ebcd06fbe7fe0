"""A server that starts with an index root and no default index, creates indexes of a text model
and of a page-image model over HTTP (empty, nothing fitted on other text), fills one by writes,
searches it exactly (filtered and explained), re-fits it in the background while it is searched
and written, and keeps it across a restart: a real `espn serve` under `ulimit -n 1024`."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from benchmarks.bench_visual import draw_page
from espn.live.create import TEMPLATES_DIR
from helpers import png, wait_until
from server_fixtures import HTTP, ServerProcess, running_server

KEY = "growth-server-test-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
SAMPLE = Path(__file__).resolve().parents[1] / "espn" / "data" / "sample_corpus.jsonl"
DOCS = [json.loads(line) for line in SAMPLE.read_text().splitlines()[:60]]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("growth-root")


def _serve(root: Path, colpali_checkpoint: Path, name: str) -> Any:
    return running_server(None, root, "--index-root", str(root / "indexes"), "--model", "small=minilm",
                          "--model", f"pages=visual:{colpali_checkpoint}", env={"ESPN_API_KEY": KEY}, name=name,
                          fd_limit=1024)


@pytest.fixture(scope="module")
def server(root: Path, colpali_checkpoint: Path) -> Iterator[ServerProcess]:
    with _serve(root, colpali_checkpoint, "growth") as server:
        yield server


def _call(server: ServerProcess, method: str, path: str, body: Any = None) -> httpx.Response:
    return HTTP.request(method, server.base_url + path, json=body, headers=AUTH, timeout=180)


def _ids(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [hit["id"] for hit in response.json()["results"]]


def test_a_server_with_only_an_index_root_is_ready_and_has_no_default_index(server: ServerProcess) -> None:
    ready = HTTP.get(server.base_url + "/readyz", headers=AUTH, timeout=60)  # a key: the index list
    assert ready.status_code == 200 and ready.json()["indexes"] == [], ready.text
    missing = _call(server, "POST", "/v1/search", {"query": "tides"})
    assert missing.status_code == 404 and missing.json()["error"] == "not_found", missing.text
    assert "no default index" in missing.json()["message"]


def test_indexes_of_text_and_of_pages_are_created_empty(server: ServerProcess, root: Path) -> None:
    for name, model in (("texts", "small"), ("pages", "pages")):
        made = _call(server, "POST", "/v1/indexes", {"name": name, "model": model})
        assert made.status_code == 201, made.text
        info = made.json()
        assert info["documents"] == 0 and info["fit"]["exact"] is True and info["fit"]["fitted_on_documents"] == 0
    listed = sorted(p.name for p in (root / "indexes").iterdir())
    assert listed == [TEMPLATES_DIR, "pages", "texts"]  # each model's files saved once, linked by its indexes
    assert _ids(_call(server, "POST", "/v1/indexes/texts/search", {"query": "tides"})) == []
    page = {"id": "red-page", "image": base64.b64encode(png(draw_page(3))).decode()}
    written = _call(server, "POST", "/v1/indexes/pages/documents/batch", {"upsert": [page]})
    assert written.status_code == 200, written.text
    assert _ids(_call(server, "POST", "/v1/indexes/pages/search", {"query": "a page", "k": 3})) == ["red-page"]


def test_a_created_index_fills_by_writes_and_is_searched_exactly(server: ServerProcess) -> None:
    upserts = [{"id": d["_id"], "title": d.get("title", ""), "text": d["text"], "metadata": {"n": i % 3}}
               for i, d in enumerate(DOCS)]
    for at in range(0, len(upserts), 20):  # three generations: base rewrites as it grows
        written = _call(server, "POST", "/v1/indexes/texts/documents/batch", {"upsert": upserts[at:at + 20]})
        assert written.status_code == 200, written.text
    target = DOCS[7]
    query = {"query": target["text"][:100], "k": 5}
    assert _ids(_call(server, "POST", "/v1/indexes/texts/search", query))[0] == target["_id"]
    filtered = _call(server, "POST", "/v1/indexes/texts/search", {**query, "filter": {"n": 7 % 3}, "explain": True})
    assert filtered.status_code == 200, filtered.text
    body = filtered.json()
    assert body["results"][0]["id"] == target["_id"] and body["results"][0]["explanation"]["matches"]
    assert body["stats"]["filter_path"] in ("exact", "all")
    info = _call(server, "GET", "/v1/indexes/texts").json()
    assert info["documents"] == len(DOCS) and info["fit"]["exact"] is True


def test_a_refit_runs_in_the_background_while_the_index_is_searched_and_written(server: ServerProcess) -> None:
    started = _call(server, "POST", "/v1/indexes/texts/refit")
    assert started.status_code == 202, started.text
    late = _call(server, "PUT", "/v1/indexes/texts/documents/late-1", {"text": "Glaciers carve fjords slowly."})
    assert late.status_code == 201, late.text  # a write while the re-fit may still run
    assert _ids(_call(server, "POST", "/v1/indexes/texts/search", {"query": "glaciers carve fjords"}))[0] == "late-1"

    def done() -> bool:
        fit = _call(server, "GET", "/v1/indexes/texts").json()["fit"]
        return fit["refit_running"] is None and fit["fitted_on_documents"] >= len(DOCS)

    wait_until(done, "the re-fit to end", timeout_s=300, interval_s=0.5)
    assert _ids(_call(server, "POST", "/v1/indexes/texts/search", {"query": "glaciers carve fjords"}))[0] == "late-1"
    metrics = HTTP.get(server.base_url + "/metrics", timeout=60).text
    assert 'espn_compactions_total{index="texts",kind="rewrite"}' in metrics


def test_created_indexes_survive_a_restart(server: ServerProcess, root: Path, colpali_checkpoint: Path) -> None:
    before = _ids(_call(server, "POST", "/v1/indexes/texts/search", {"query": DOCS[3]["text"][:80], "k": 5}))
    server.terminate()
    with _serve(root, colpali_checkpoint, "growth-again") as again:
        names = [item["name"] for item in _call(again, "GET", "/v1/indexes").json()["indexes"]]
        assert names == ["pages", "texts"]
        assert _ids(_call(again, "POST", "/v1/indexes/texts/search", {"query": DOCS[3]["text"][:80], "k": 5})) == before
        assert _call(again, "GET", "/v1/indexes/texts/documents/late-1").json()["text"].startswith("Glaciers")
        assert _call(again, "POST", "/v1/indexes", {"name": "third", "model": "small"}).status_code == 201
