"""Queries are text: what users paste (every ASCII punctuation character, unbalanced quotes,
AND/OR/NOT, leading -/+, colons, 2,000-character citing paragraphs, non-Latin scripts) goes
through the batch CLI, /v1/search, /v1/search/batch, the router and the page's own request
without one failure, plain by default and with the simple syntax on; and one bad query in a
batch costs only itself. On the bundled sample index, against a real `espn serve`; the router
runs in-process over real HTTP to it."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from server_fixtures import running_server

from espn.cli import main as cli_main
from espn_server.router import RouterSettings, build_router_app

CITATION = ('Quarteroni, A. and Valli, A., "Numerical approximation of partial differential equations", Springer; '
            'see also Kato, T., "Perturbation theory for closed linear operators", SIAM J. Numerical Analysis: '
            "the moon's orbit (+/- 0.5%) -- NOT a lunar eclipse AND (red OR copper) ")
PARAGRAPH = (CITATION * 8)[:2000]
NON_LATIN = ["月食 红色的月亮", "лунное затмение луна", "خسوف القمر", "चंद्र ग्रहण", "🌕 🌑 eclipse", "Mondfinsternis über Köln"]
MESSY = [
    *(f"moon {c} eclipse" for c in string.punctuation),
    *(f"moon{c}eclipse" for c in string.punctuation),
    string.punctuation,
    'moon "red', '"lunar eclipse', 'eclipse"', '"', '""', '"""', "moon \"", "a \" b \" c \"",
    "moon AND sun", "eclipse OR tides NOT storm", "NOT", "AND OR NOT", "NOT moon",
    "-moon", "+moon", "-", "+", "--moon", "+-moon", "-+", '-"lunar eclipse"', "- moon", "-moon -sun",
    "title:moon", "text: eclipse", "doc_number:1", "body:moon", ":", "moon: red", "http://example.org/a?b=c&d",
    "moon~2 eclipse^3 (red)* [a TO b] {x} \\ / && || !", "f(x) = a*b + c; // why?", "2024-05-01T12:00:00Z ERROR [main]",
    CITATION, PARAGRAPH, *NON_LATIN,
]
#: Queries with at least one word: each of them must find something in hybrid mode.
WORDY = [q for q in MESSY if any(ch.isalnum() for ch in q)]


def _page_body(query: str, syntax: str | None) -> dict[str, Any]:
    """What the search page's requestBody() sends (server/page/search.js)."""
    body = {"query": query, "k": 5, "prefetch": True, "return_text": True, "explain": True, "mode": "hybrid"}
    return body if syntax is None else {**body, "syntax": syntax}


@pytest.fixture(scope="module")
def server(sample_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_server(sample_index, tmp_path_factory.mktemp("query-text-logs"), "--batch-wait-ms", "2",
                        name="query-text") as running:
        yield running


@pytest.fixture(scope="module")
def client(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120.0) as http:
        yield http


@pytest.fixture(scope="module")
def router(server: Any) -> Iterator[TestClient]:
    with TestClient(build_router_app(RouterSettings(shards=[server.base_url], timeout_ms=120_000.0))) as routed:
        yield routed


def test_corpus_is_what_it_claims() -> None:
    assert len(PARAGRAPH) == 2000 and set(string.punctuation) <= set("".join(MESSY))
    assert len(WORDY) > 70 and any(q.count('"') % 2 for q in MESSY)


@pytest.mark.parametrize("syntax", [None, "simple"])
def test_every_query_is_answered_over_http_the_router_and_the_page(client: httpx.Client, router: TestClient,
                                                                    syntax: str | None) -> None:
    extra = {} if syntax is None else {"syntax": syntax}
    for mode in ("hybrid", "lexical"):
        batch = client.post("/v1/search/batch", json={"queries": MESSY, "k": 5, "mode": mode, **extra})
        assert batch.status_code == 200, batch.text[:500]
        body = batch.json()
        assert body["errors"] == [] and [r["index"] for r in body["responses"]] == list(range(len(MESSY)))
        if mode == "hybrid":
            assert all(r["results"] for r in body["responses"] if r["query"] in WORDY)
        for response in body["responses"]:
            assert response["stats"]["syntax"] == (syntax or "plain")
            assert ("ignored" in response["stats"]) == (syntax == "simple" and bool(response["stats"].get("ignored")))
        routed = router.post("/v1/search/batch", json={"queries": MESSY, "k": 5, "mode": mode, **extra})
        assert routed.status_code == 200 and routed.json()["errors"] == [], routed.text[:500]
        routed_ids = [[h["id"] for h in r["results"]] for r in routed.json()["responses"]]
        if mode == "lexical":  # the same BM25 ranking (hybrid re-fuses the partitions' deeper pools)
            assert routed_ids == [[h["id"] for h in r["results"]] for r in body["responses"]]
        else:
            assert all(ids for ids, query in zip(routed_ids, MESSY) if query in WORDY)
    for query in MESSY:
        single = client.post("/v1/search", json={"query": query, "k": 5, "mode": "hybrid", **extra})
        assert single.status_code == 200, (query, single.text[:300])
        assert single.json()["results"] or query not in WORDY, query
        routed = router.post("/v1/search", json={"query": query, "k": 5, "mode": "hybrid", **extra})
        assert routed.status_code == 200 and (routed.json()["results"] or query not in WORDY), query
        assert routed.json()["stats"]["ignored"] == single.json()["stats"].get("ignored"), query
    for query in WORDY[::3]:  # the page's own request (explain and text on); fewer: explain costs more
        page = client.post("/v1/search", json=_page_body(query, syntax))
        assert page.status_code == 200 and page.json()["results"], (query, page.text[:300])


def test_plain_text_is_never_an_operator_and_simple_says_what_it_ignored(client: httpx.Client) -> None:
    def ids(query: str, **extra: Any) -> list[str]:
        body = client.post("/v1/search", json={"query": query, "k": 10, "mode": "lexical", **extra}).json()
        return [hit["id"] for hit in body["results"]]

    # Plain: "-" and quotes are punctuation, so these read the same words as the bare text.
    assert ids('-moon "lunar eclipse"') == ids("moon lunar eclipse") != []
    assert ids("moon -eclipse", syntax="simple") != ids("moon -eclipse")
    answer = client.post("/v1/search", json={"query": 'moon "red', "mode": "hybrid", "syntax": "simple"}).json()
    assert answer["stats"]["ignored"] == ["unclosed quote at position 5: read as text"] and answer["results"]
    assert "ignored" not in client.post("/v1/search", json={"query": 'moon "red', "mode": "hybrid"}).json()["stats"]
    bad = client.post("/v1/search", json={"query": "moon", "mode": "hybrid", "syntax": "lucene"})
    assert bad.status_code == 422 and "syntax" in bad.text


def _hundred(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """100 queries, 3 of them bad: too long, empty, nothing but control characters."""
    bad = {"q017": "x" * 10_001, "q050": "", "q083": "\u200b\x07 \x00"}
    words = ["moon", "eclipse", "ocean", "tides", "volcano", "search", "engine", "planet", "red", "storm"]
    queries = {f"q{i:03d}": bad.get(f"q{i:03d}", f"{words[i % 10]} {words[(i * 7) % 10]} {i}") for i in range(100)}
    path = tmp_path / "queries.jsonl"
    path.write_text("".join(json.dumps({"_id": qid, "text": text}) + "\n" for qid, text in queries.items()))
    return path, bad


@pytest.mark.parametrize("mode", ["hybrid", "dense"])
def test_a_batch_with_three_bad_queries_answers_the_other_97(sample_index: Path, tmp_path: Path, capsys: Any,
                                                             mode: str) -> None:
    queries, bad = _hundred(tmp_path)
    out = tmp_path / "run.trec"
    assert cli_main(["search", str(sample_index), "--queries", str(queries), "--out", str(out), "--k", "5",
                     "--mode", mode, "--batch-size", "16"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("espn search: error: ")]
    assert sorted(line.split(":")[2].strip().removeprefix("query ") for line in err[:-1]) == sorted(bad)
    assert "3 of 100 queries failed" in err[-1] and len(err) == 4
    answered = {line.split()[0] for line in out.read_text().splitlines()}
    assert len(answered) == 97 and not answered & set(bad)
    assert cli_main(["search", str(sample_index), "--queries", str(queries), "--out", str(tmp_path / "strict"),
                     "--mode", mode, "--strict"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("espn search: error: ")]
    assert not (tmp_path / "strict").exists() and len(err) == 1 and "query q017: the query has 10001 characters" in err[0]


def test_cli_batch_of_messy_queries(sample_index: Path, tmp_path: Path) -> None:
    path = tmp_path / "messy.jsonl"
    path.write_text("".join(json.dumps({"_id": f"m{i}", "text": q}) + "\n" for i, q in enumerate(MESSY)))
    wordy = {f"m{i}" for i, q in enumerate(MESSY) if q in WORDY}
    for syntax in ("plain", "simple"):
        out = tmp_path / f"{syntax}.trec"
        assert cli_main(["search", str(sample_index), "--queries", str(path), "--out", str(out), "--k", "5",
                         "--mode", "hybrid", "--query-syntax", syntax]) == 0
        assert wordy <= {line.split()[0] for line in out.read_text().splitlines()}


def test_http_batch_with_three_bad_queries(client: httpx.Client, router: TestClient, tmp_path: Path) -> None:
    queries, bad = _hundred(tmp_path)
    texts = [json.loads(line)["text"] for line in queries.read_text().splitlines()]
    bad_rows = sorted(int(qid[1:]) for qid in bad)
    bad_rows_texts = [texts[i] for i in bad_rows]
    assert bad_rows_texts[0] == "x" * 10_001
    for http in (client, router):
        answer = http.post("/v1/search/batch", json={"queries": texts, "k": 3, "mode": "hybrid"})
        assert answer.status_code == 200, answer.text[:300]
        body = answer.json()
        assert [e["index"] for e in body["errors"]] == bad_rows
        assert all(e["error"] == "invalid_query" and e["message"].startswith(f"queries[{e['index']}]: ")
                   for e in body["errors"])
        assert [r["index"] for r in body["responses"]] == [i for i in range(100) if i not in bad_rows]
        assert all(r["results"] for r in body["responses"])
