"""Where the features meet: a written (live) index, restarted, under `ulimit -n 1024`,
searched with a filter and explained from the pooling groups its writes stored; and the same
for an index of residual records."""

from __future__ import annotations

import shutil
from pathlib import Path


from espn import Searcher
from espn.generation.format import read_current
from espn.index import read_manifest
from helpers import run_espn
from server_fixtures import HTTP, running_server

SAMPLE_CORPUS = Path(__file__).parents[1] / "espn" / "data" / "sample_corpus.jsonl"

DOC = {"title": "Eclipse night", "text": "A lunar eclipse darkens the Moon when the shadow of the Earth falls on it.",
       "metadata": {"topic": "written-here", "year": 2026}}


def _the_written_document_filtered_and_explained(base_url: str) -> list[dict]:
    """The hits of a search filtered to the written document's topic, explained, with its text."""
    response = HTTP.post(f"{base_url}/v1/search", timeout=120, json={
        "query": "lunar eclipse moon", "k": 3, "filter": {"topic": {"in": ["written-here"]}},
        "explain": True, "return_text": True})
    assert response.status_code == 200, response.text
    hits = response.json()["results"]
    assert [hit["id"] for hit in hits] == ["written-1"]
    return hits


def test_a_written_index_restarted_filters_and_explains_its_writes(sample_index: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    shutil.copytree(sample_index, index)
    with running_server(index, tmp_path, "--no-warmup", name="writer", fd_limit=1024) as server:
        put = HTTP.put(f"{server.base_url}/v1/documents/written-1", json=DOC, timeout=120)
        assert put.status_code == 201, put.text
    # The write's delta carries the pooling groups of its records (the sample index is pooled).
    segments = read_current(index).segments
    assert segments and any(name.endswith("pool_groups.npy") for s in segments for name in s.files)

    with running_server(index, tmp_path, "--no-warmup", name="restarted", fd_limit=1024) as server:
        hits = _the_written_document_filtered_and_explained(server.base_url)
        words = {m["token"]: [hits[0][s["field"]][s["start"]:s["end"]] for s in m["spans"] if s["field"] != "joiner"]
                 for m in hits[0]["explanation"]["matches"]}
        assert "Moon" in " ".join(words["moon"]) and "eclipse" in " ".join(words["eclipse"])


def test_a_residual_index_served_across_a_restart_answers_its_own_exact_maxsim(tmp_path: Path) -> None:
    """Residual records (a centroid id and 4 bits a dimension) through a real server: a write
    coded against the base's centroids, a delete, a restart under `ulimit -n 1024`, then a
    filtered, explained search whose ranking is the index's own exhaustive MaxSim."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(SAMPLE_CORPUS.open().readlines()[:48]))
    index = tmp_path / "index"
    run_espn("index", corpus, "--out", index, "--bow-dtype", "residual4", "--first-stage", "centroids",
             "--score-weight", "0", "--no-progress", "--no-text-index")
    assert read_manifest(index)["store"]["dtype"] == "residual4"
    with running_server(index, tmp_path, "--no-warmup", name="residual-writer", fd_limit=1024) as server:
        put = HTTP.put(f"{server.base_url}/v1/documents/written-1", json=DOC, timeout=120)
        assert put.status_code == 201, put.text
        gone = HTTP.delete(f"{server.base_url}/v1/documents/s0002", timeout=120)
        assert gone.status_code == 200, gone.text

    with running_server(index, tmp_path, "--no-warmup", name="residual-restarted", fd_limit=1024) as server:
        hits = _the_written_document_filtered_and_explained(server.base_url)
        assert hits[0]["explanation"]["matches"]
        served = HTTP.post(f"{server.base_url}/v1/search", timeout=120, json={
            "query": "phases of the moon", "k": 10, "first_stage_candidates": 100})
        assert served.status_code == 200, served.text
    ranked = [hit["id"] for hit in served.json()["results"]]
    with Searcher.open(index, verify="full") as searcher:
        exact = searcher.search_maxsim_exhaustive(searcher.encode(["phases of the moon"]), k=10)[0]
    assert "s0002" not in ranked and ranked == [hit.doc_id for hit in exact]
