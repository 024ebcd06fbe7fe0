"""Queries longer than the model's query length: cut as the model's library cuts them (espn.search.long_queries),
and said so the same way by the library, `espn search` and HTTP.

The index is the PyLate 1.6.0 BERT fixture (query length 32) over the sample corpus; the long query
is its reference's last one (hundreds of characters).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from espn.encoders import encoder_from_spec
from espn.search.long_queries import LONG_QUERY_RULE
from espn.search.searcher import Searcher
from espn_indexing.build import BuildConfig, build_index
from helpers import run_espn
from server_fixtures import HTTP, running_server

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "model_fixtures"
PYLATE = FIXTURES / "pylate-1.6-bert"
SAMPLE = ROOT / "espn" / "data" / "sample_corpus.jsonl"
LONG = json.loads((PYLATE / "reference.json").read_text())["queries"][-1]
SHORT = "what causes ocean tides"


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("long") / "index"
    build_index(BuildConfig(corpus=SAMPLE, out=out, encoder=f"colbert:{PYLATE}", nlist=4, bow_dtype="float16",
                            loader_workers=0, progress=False, text_index=None, device="cpu"))
    return out


@pytest.fixture(scope="module")
def library(index: Path) -> dict[str, object]:
    """What the library answers for the short and the long query, and for the long one cut where the model stopped."""
    with Searcher.open(index) as searcher:
        short, long = searcher.search([SHORT, LONG], k=5)
        read = long.stats.query_read_chars
        assert read is not None
        (cut,) = searcher.search([LONG[:read]], k=5)
    return {"short": short, "long": long, "cut": cut, "read": read}


def test_a_long_query_is_cut_where_the_model_stops_reading(library: dict) -> None:
    short, long, cut, read = library["short"], library["long"], library["cut"], library["read"]
    assert LONG_QUERY_RULE == "truncate"
    assert not short.stats.query_truncated and short.stats.query_read_chars is None
    assert long.stats.query_truncated and 0 < read < len(LONG) // 2
    # Truncation: the long query scores exactly as the part the model read.
    assert [h.doc_id for h in long.hits] == [h.doc_id for h in cut.hits]
    np.testing.assert_allclose([h.score for h in long.hits], [h.score for h in cut.hits], rtol=1e-5)
    assert not cut.stats.query_truncated  # exactly the query length: read whole


def test_espn_search_says_which_queries_were_cut(index: Path, library: dict, tmp_path: Path) -> None:
    queries = tmp_path / "queries.jsonl"
    queries.write_text(json.dumps({"_id": "short", "text": SHORT}) + "\n" + json.dumps({"_id": "long", "text": LONG})
                       + "\n")
    run = tmp_path / "run.trec"
    proc = run_espn("search", index, "--queries", queries, "--out", run, "--k", "5")
    assert "1 of 2 queries were longer than the model's query length and were cut as its library cuts them (long)" \
        in proc.stdout
    ranked = [line.split()[2] for line in run.read_text().splitlines() if line.startswith("long ")]
    assert ranked == [h.doc_id for h in library["long"].hits]


def test_http_says_which_queries_were_cut(index: Path, library: dict, tmp_path: Path) -> None:
    with running_server(index, tmp_path) as server:
        long = HTTP.post(f"{server.base_url}/v1/search", json={"query": LONG, "k": 5}, timeout=60).json()
        short = HTTP.post(f"{server.base_url}/v1/search", json={"query": SHORT, "k": 5}, timeout=60).json()
        batch = HTTP.post(f"{server.base_url}/v1/search/batch", json={"queries": [SHORT, LONG], "k": 5},
                          timeout=60).json()
    assert long["stats"]["query_truncated"] is True and long["stats"]["query_read_chars"] == library["read"]
    assert [h["id"] for h in long["results"]] == [h.doc_id for h in library["long"].hits]
    assert "query_truncated" not in short["stats"]
    answers = batch["responses"]
    flags = [answer["stats"].get("query_truncated") for answer in answers]
    assert flags == [None, True]


@pytest.mark.parametrize("name", ["st-6.2-bert-prompts-expansion", "st-6.2-modernbert-prompts-expansion",
                                  "colbert-ai-0.2.22-bert"])
def test_every_text_family_says_when_it_cut_a_query(name: str) -> None:
    encoder = encoder_from_spec(f"colbert:{FIXTURES / name}", device="cpu")
    truncated = encoder.encode_queries([SHORT, LONG]).truncated
    assert truncated is not None and truncated.tolist() == [False, True]


def test_a_model_without_a_query_length_reads_the_query_whole() -> None:
    """Sentence Transformers' default chain sets no query length: a query is read up to the backbone's 512."""
    encoder = encoder_from_spec(f"colbert:{FIXTURES / 'st-6.2-modernbert-plain'}", device="cpu")
    assert encoder.encode_queries([SHORT, LONG]).truncated.tolist() == [False, False]  # type: ignore[union-attr]
