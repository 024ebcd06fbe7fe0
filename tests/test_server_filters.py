"""`"filter"` on /v1/search and /v1/search/batch, against a real `espn serve` of the sample index."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from server_fixtures import running_server

QUERY = "What causes tides in the ocean?"


@pytest.fixture(scope="module")
def searcher(sample_index: Path):
    from espn import Searcher

    with Searcher.open(sample_index) as opened:
        yield opened


@pytest.fixture(scope="module")
def client(sample_index: Path, tmp_path_factory: pytest.TempPathFactory):
    with running_server(sample_index, tmp_path_factory.mktemp("logs"), "--batch-wait-ms", "5",
                        name="filters") as server:
        with httpx.Client(base_url=server.base_url, timeout=60.0) as http:
            yield http


def test_the_first_search_after_readyz_is_as_fast_as_the_next(client: httpx.Client) -> None:
    """First in this file: the server's first search. Warm-up (on by default) ran the encoder's
    lone and batched paths before /readyz said ready, so the first user pays no start-up cost
    (it once spent 1.8 s in `encode`)."""
    def encode_ms(query: str) -> float:
        response = client.post("/v1/search", json={"query": query, "k": 5})
        assert response.status_code == 200, response.text
        return float(response.json()["stats"]["stage_ms"]["encode"])

    first = encode_ms("why does the moon turn red during a lunar eclipse")
    later = sorted(encode_ms(f"why does the ocean have tides on day {day} of the month") for day in range(7))
    median = later[len(later) // 2]
    # A cold start spent 1.8 s here; under CI's four workers on 2 cores a warm first search has
    # taken 195 ms against a 21 ms median (a scheduling delay), so the bound tells the two apart
    # and no more.
    assert first <= 3 * median + 500, (first, later)


def test_filtered_search_equals_the_library(client: httpx.Client, searcher) -> None:
    spec = {"topic": {"in": ["oceans", "weather"]}, "year": {"gte": 2000}}
    response = client.post("/v1/search", json={"query": QUERY, "k": 5, "filter": spec})
    assert response.status_code == 200, response.text
    body = response.json()
    want = searcher.search([QUERY], k=5, filter=spec)[0]
    assert [hit["id"] for hit in body["results"]] == [h.doc_id for h in want.hits]
    assert [hit["score"] for hit in body["results"]] == pytest.approx([h.score for h in want.hits], abs=1e-5)
    mask = searcher.filtered_docs(spec).mask
    assert all(mask[searcher.ids.internal(hit["id"])] for hit in body["results"])
    assert body["stats"]["matched"] == int(mask.sum()) and body["stats"]["filter_path"] == "exact"
    plain = client.post("/v1/search", json={"query": QUERY, "k": 5}).json()
    assert "matched" not in plain["stats"]  # unfiltered answers are unchanged


def test_batch_with_a_filter(client: httpx.Client, searcher) -> None:
    spec = {"tags": "technology"}
    queries = [QUERY, "how do computers send data over a network", "fast trains"]
    response = client.post("/v1/search/batch", json={"queries": queries, "k": 4, "filter": spec})
    assert response.status_code == 200, response.text
    mask = searcher.filtered_docs(spec).mask
    for query, answer in zip(queries, response.json()["responses"]):
        assert len(answer["results"]) == 4 and all(mask[searcher.ids.internal(h["id"])] for h in answer["results"])
        assert [h["id"] for h in answer["results"]] == [h.doc_id for h in searcher.search([query], k=4,
                                                                                          filter=spec)[0].hits]


@pytest.mark.parametrize("spec, message", [
    ({"colour": "red"}, "unknown field 'colour'"),
    ({"year": "2001"}, "field 'year' is integer"),
    ({"topic": {"gt": 3}}, "range operators apply to integer and float fields"),
    ({"or": []}, "filter.or: expected a non-empty list"),
    ({"year": {"between": [1, 2]}}, "unknown operator 'between'"),
    ("topic=oceans", None),
])
def test_bad_filters_get_a_422_naming_the_problem(client: httpx.Client, spec: Any, message: str | None) -> None:
    for path, body in (("/v1/search", {"query": QUERY, "filter": spec}),
                       ("/v1/search/batch", {"queries": [QUERY], "filter": spec})):
        response = client.post(path, json=body)
        assert response.status_code == 422, response.text
        payload = response.json()
        assert payload["error"] in ("invalid_parameter", "invalid_request")
        if message is not None:
            assert message in payload["message"], payload
        assert "Traceback" not in response.text


@pytest.mark.parametrize("body, where", [
    ('{"query": "tides"', "at line 1, column 18 (byte 17, the end of the body: is it cut short?)"),
    ('{\n  "query": "tides"\n', "at line 3, column 1 (byte 21, the end of the body: is it cut short?)"),
    ('{"query": "marée", "k": }', "at line 1, column 25 (byte 25)"),
])
def test_malformed_json_says_where_the_parser_stopped(client: httpx.Client, body: str, where: str) -> None:
    """A body cut short is found out at its end: the message points there, in line, column and byte."""
    response = client.post("/v1/search", content=body.encode("utf-8"), headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"] == "malformed_json", response.text
    assert response.json()["message"].endswith(where), response.json()["message"]
