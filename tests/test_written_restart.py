"""Where the features meet: a written (live) index, restarted, under `ulimit -n 1024`,
searched with a filter and explained from the pooling groups its writes stored."""

from __future__ import annotations

import shutil
from pathlib import Path


from espn.generation.format import read_current
from server_fixtures import HTTP, running_server

DOC = {"title": "Eclipse night", "text": "A lunar eclipse darkens the Moon when the shadow of the Earth falls on it.",
       "metadata": {"topic": "written-here", "year": 2026}}


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
        response = HTTP.post(f"{server.base_url}/v1/search", timeout=120, json={
            "query": "lunar eclipse moon", "k": 3, "filter": {"topic": {"in": ["written-here"]}},
            "explain": True, "return_text": True})
        assert response.status_code == 200, response.text
        hits = response.json()["results"]
        assert [hit["id"] for hit in hits] == ["written-1"]
        words = {m["token"]: [hits[0][s["field"]][s["start"]:s["end"]] for s in m["spans"] if s["field"] != "joiner"]
                 for m in hits[0]["explanation"]["matches"]}
        assert "Moon" in " ".join(words["moon"]) and "eclipse" in " ".join(words["eclipse"])
