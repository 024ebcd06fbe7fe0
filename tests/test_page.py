"""The search page and `"explain"` over HTTP, against a real `espn serve` on the sample index.

The browser test drives Debian's headless Chromium through its chromedriver (both
installed by `make browser`, which `make test` runs): it fails, not skips, when they are
missing, unless ESPN_BROWSER_TESTS=0 turns it off. ESPN_UPDATE_SCREENSHOT=1 also writes
the screenshot the docs show (docs/search-page.png).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import httpx
import pytest
from server_fixtures import HTTP, running_server

API_KEY = "page-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROOT = Path(__file__).resolve().parents[1]
QUERY = "why does the moon turn red during a lunar eclipse"


@pytest.fixture(scope="module")
def server(sample_index: Path, tmp_path_factory: pytest.TempPathFactory):
    with running_server(sample_index, tmp_path_factory.mktemp("page-logs"), "--batch-wait-ms", "2",
                        env={"ESPN_API_KEY": API_KEY}, name="page") as running:
        yield running


@pytest.fixture()
def client(server) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=60.0) as http:
        yield http


def test_explain_off_is_todays_response(client: httpx.Client) -> None:
    body = {"query": QUERY, "k": 6, "rerank_count": 4}
    plain = client.post("/v1/search", json=body).json()
    off = client.post("/v1/search", json={**body, "explain": False}).json()
    on = client.post("/v1/search", json={**body, "explain": True}).json()
    assert all(set(hit) == {"id", "score", "cls_score", "bow_score"} for hit in plain["results"])
    assert [hit for hit in off["results"]] == plain["results"]
    assert [{key: hit[key] for key in ("id", "score", "cls_score", "bow_score")} for hit in on["results"]] \
        == plain["results"]
    assert ["explanation" in hit for hit in on["results"]] == [True] * 4 + [False] * 2  # re-ranked hits only
    assert "explain" in on["stats"]["stage_ms"] and "explain" not in plain["stats"]["stage_ms"]
    for hit in on["results"][:4]:
        e = hit["explanation"]
        assert sum(m["contribution"] for m in e["matches"]) == pytest.approx(hit["bow_score"], abs=1e-5)
        assert e["cls_part"] + e["bow_part"] == pytest.approx(hit["score"], abs=1e-5)


def test_explained_spans_point_into_the_returned_text(client: httpx.Client) -> None:
    hit = client.post("/v1/search", json={"query": QUERY, "k": 1, "explain": True, "return_text": True}).json()[
        "results"][0]
    words = {m["token"]: [hit[s["field"]][s["start"]:s["end"]] for s in m["spans"] if s["field"] != "joiner"]
             for m in hit["explanation"]["matches"]}
    # The same word, in the passage (a vector pooled at index time may also cover its neighbours).
    assert "Moon" in words["moon"] and "eclipse" in words["eclipse"]
    assert all(text.strip() for texts in words.values() for text in texts)


@pytest.mark.parametrize("body, message", [
    ({"query": QUERY, "k": 101, "explain": True}, "at most k=100"),
    ({"query": QUERY, "explain": "yes"}, "explain"),
])
def test_bad_explain_requests_are_422(client: httpx.Client, body: dict, message: str) -> None:
    response = client.post("/v1/search", json=body)
    assert response.status_code == 422 and message in response.json()["message"]
    batch = client.post("/v1/search/batch", json={"queries": [QUERY], "explain": True})
    assert batch.status_code == 422 and "explain" in batch.json()["message"]


def test_the_page_and_its_assets_are_served_offline(server) -> None:
    page = HTTP.get(f"{server.base_url}/")  # the page itself needs no key; its API calls do
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    links = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert links and all(link.startswith(("/", "data:")) for link in links), links  # nothing from a CDN
    for asset in ("search.js", "search.css"):
        response = HTTP.get(f"{server.base_url}/page-assets/{asset}")
        assert response.status_code == 200 and len(response.text) > 500
        assert "http://" not in response.text and "https://" not in response.text


def test_search_page_in_a_real_browser(browser, server, client: httpx.Client, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 60)
    browser.get(f"{server.base_url}/")
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    # Explanations cost a pass of their own: off until the user asks, then remembered.
    explain = browser.find_element(By.ID, "explain")
    assert not explain.is_selected()
    explain.click()
    browser.refresh()
    assert browser.find_element(By.ID, "explain").is_selected()
    assert browser.execute_script("return localStorage.getItem('espn-explain')") == "on"
    browser.find_element(By.ID, "query").send_keys(QUERY)
    k = browser.find_element(By.ID, "k")
    k.clear()
    k.send_keys("5")
    browser.find_element(By.ID, "search-button").click()

    # The server wants a key: the page asks for it once ...
    wait.until(lambda b: b.find_element(By.ID, "key-form").is_displayed())
    browser.find_element(By.ID, "api-key").send_keys(API_KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "li.result")) == 5)

    # ... and shows what the API answers: the same ranking, with the matched words highlighted.
    expected = client.post("/v1/search", json={"query": QUERY, "k": 5, "explain": True, "return_text": True,
                                               "prefetch": True}).json()["results"]
    items = browser.find_elements(By.CSS_SELECTOR, "li.result")
    assert [item.get_attribute("data-id") for item in items] == [hit["id"] for hit in expected]
    first, hit = items[0], expected[0]
    marked = {mark.text for mark in first.find_elements(By.CSS_SELECTOR, ".text mark.hl")}
    spans = {hit["text"][s["start"]:s["end"]] for m in hit["explanation"]["matches"] for s in m["spans"]
             if s["field"] == "text"}
    assert marked and marked <= spans and {"Moon", "eclipse"} <= marked
    strengths = [float(mark.get_attribute("data-strength")) for mark in first.find_elements(By.CSS_SELECTOR, "mark.hl")]
    assert all(0.0 <= s <= 1.0 for s in strengths) and len(set(strengths)) > 1  # strong and weak matches differ
    assert hit["id"] in first.text and hit["title"] in first.text
    stats = browser.find_element(By.ID, "stats")
    assert stats.is_displayed()
    stages = {row.get_attribute("data-stage") for row in stats.find_elements(By.CSS_SELECTOR, ".stage")}
    assert {"encode", "ann", "maxsim", "explain"} <= stages
    assert re.search(r"hit rate \d+%", stats.text) and re.search(r"bytes read [\d.]+ (B|KiB|MiB)", stats.text)
    same_origin = browser.execute_script(
        "return performance.getEntriesByType('resource').every(e => e.name.startsWith(location.origin))")
    assert same_origin  # no CDN, no outside request

    shot = tmp_path / "search-page.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
    if os.environ.get("ESPN_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "search-page.png")

    # The key is kept for the session: a second search does not ask again.
    query = browser.find_element(By.ID, "query")
    query.clear()
    query.send_keys("what causes ocean tides")
    browser.find_element(By.ID, "search-button").click()
    # Read in the page, in one step: the list is replaced while it renders (no stale element).
    first_id = "const r = document.querySelector('li.result'); return r ? r.dataset.id : null"
    wait.until(lambda b: b.execute_script(first_id) not in (None, hit["id"]))
    assert not browser.find_element(By.ID, "key-form").is_displayed()
    assert browser.find_elements(By.CSS_SELECTOR, "li.result mark.hl")
    second_id = browser.execute_script(first_id)

    # With the box unticked the page asks for no explanation: no explain stage, no highlights.
    browser.find_element(By.ID, "explain").click()
    assert browser.execute_script("return localStorage.getItem('espn-explain')") == "off"
    query = browser.find_element(By.ID, "query")
    query.clear()
    query.send_keys(QUERY)
    browser.find_element(By.ID, "search-button").click()
    wait.until(lambda b: b.execute_script(first_id) not in (None, second_id))
    stages = {row.get_attribute("data-stage") for row in browser.find_elements(By.CSS_SELECTOR, "#stats .stage")}
    assert "explain" not in stages and {"encode", "ann", "maxsim"} <= stages
    assert not browser.find_elements(By.CSS_SELECTOR, "li.result mark.hl")
    assert [item.get_attribute("data-id") for item in browser.find_elements(By.CSS_SELECTOR, "li.result")] == \
        [hit["id"] for hit in expected]


def test_modes_over_http(client: httpx.Client) -> None:
    """mode, fusion and the lexical syntax on /v1/search and /v1/search/batch, with their 422s."""
    dense = client.post("/v1/search", json={"query": QUERY, "k": 5}).json()
    assert "mode" not in dense["stats"] and all("dense_score" not in hit for hit in dense["results"])
    for mode in ("lexical", "hybrid"):
        body = client.post("/v1/search", json={"query": QUERY, "k": 5, "mode": mode, "fusion": "rrf"}).json()
        assert body["stats"]["mode"] == mode and len(body["results"]) == 5
        assert all("lexical_score" in hit and "dense_score" in hit for hit in body["results"])
        if mode == "lexical":
            assert all(hit["cls_score"] is None and hit["score"] == hit["lexical_score"] for hit in body["results"])
        else:
            assert body["stats"]["hybrid"]["fusion"] == "rrf" and body["stats"]["hybrid"]["rerank_count"] >= 1
    batch = client.post("/v1/search/batch", json={"queries": [QUERY, "ocean tides"], "k": 3, "mode": "hybrid"})
    assert batch.status_code == 200 and [r["stats"]["mode"] for r in batch.json()["responses"]] == ["hybrid"] * 2
    for body, status, message in [
        ({"query": QUERY, "mode": "sparse"}, 422, "mode"),
        ({"query": QUERY, "mode": "hybrid", "lexical_k": 0}, 422, "lexical_k"),
        ({"query": QUERY, "mode": "hybrid", "mix_weight": 2}, 422, "mix_weight"),
        ({"query": QUERY, "mode": "hybrid", "syntax": "lucene"}, 422, "syntax"),
    ]:
        response = client.post("/v1/search", json=body)
        assert response.status_code == status and message in response.json()["message"], response.text
    # Quotes are text; a blank query in a batch is that query's error, the others are answered.
    batch = client.post("/v1/search/batch", json={"queries": ["fine", 'a "b', "   "], "mode": "lexical"})
    assert batch.status_code == 200 and [r["index"] for r in batch.json()["responses"]] == [0, 1]
    assert [(e["index"], e["error"]) for e in batch.json()["errors"]] == [(2, "invalid_query")]
    explained = client.post("/v1/search", json={"query": QUERY, "k": 2, "mode": "lexical", "explain": True}).json()
    for hit in explained["results"]:
        assert sum(m["score"] for m in hit["lexical_matches"]) == pytest.approx(hit["lexical_score"], rel=1e-4)


def test_mode_switch_in_a_real_browser(browser, server, client: httpx.Client) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    wait = WebDriverWait(browser, 60)
    browser.get(f"{server.base_url}/")
    if not browser.find_element(By.ID, "explain").is_selected():
        browser.find_element(By.ID, "explain").click()
    first_id = "const r = document.querySelector('li.result'); return r ? r.dataset.id : null"
    for mode in ("hybrid", "lexical"):
        Select(browser.find_element(By.ID, "mode")).select_by_value(mode)
        query = browser.find_element(By.ID, "query")
        query.clear()
        query.send_keys(QUERY)
        k = browser.find_element(By.ID, "k")
        k.clear()
        k.send_keys("4")
        browser.execute_script("document.getElementById('results').replaceChildren()")
        browser.find_element(By.ID, "search-button").click()
        if browser.find_element(By.ID, "key-form").is_displayed() or not browser.execute_script(
                "return sessionStorage.getItem('espn-api-key')"):
            wait.until(lambda b: b.find_element(By.ID, "key-form").is_displayed())
            browser.find_element(By.ID, "api-key").send_keys(API_KEY)
            browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait.until(lambda b: b.execute_script(first_id) is not None)
        expected = client.post("/v1/search", json={"query": QUERY, "k": 4, "mode": mode, "explain": True,
                                                   "return_text": True}).json()["results"]
        items = browser.find_elements(By.CSS_SELECTOR, "li.result")
        assert [item.get_attribute("data-id") for item in items] == [hit["id"] for hit in expected], mode
        chips = [chip.find_element(By.CSS_SELECTOR, ".q").text
                 for chip in items[0].find_elements(By.CSS_SELECTOR, ".matches.lexical .match")]
        # A chip shows the word as the user typed it ("eclipse"), not the stem the index holds ("eclips").
        typed = [QUERY[m["query_start"]:m["query_end"]] for m in expected[0]["lexical_matches"]]
        assert chips == typed and chips, mode
        assert "eclipse" in chips and any(m["terms"] == "eclips" for m in expected[0]["lexical_matches"]), chips
        if mode == "hybrid":
            assert "fused from dense" in items[0].text
            assert items[0].find_elements(By.CSS_SELECTOR, ".text mark.hl:not(.lx)")  # MaxSim highlights
        else:
            marked = {mark.text for mark in items[0].find_elements(By.CSS_SELECTOR, ".text mark.hl.lx")}
            spans = {expected[0]["text"][s["start"]:s["end"]] for m in expected[0]["lexical_matches"]
                     for s in m["spans"] if s["field"] == "text"}
            assert marked and marked <= spans and "eclipse" in {word.lower() for word in marked}, (marked, spans)


def test_api_docs_page_renders_the_operations_in_a_real_browser(browser, server) -> None:
    """/docs shows the OpenAPI 3.1 document's operations (Swagger UI 4 showed "Unable to render
    this definition" for it), from assets this server serves itself."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{server.base_url}/docs")
    WebDriverWait(browser, 60).until(lambda b: b.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")
                                     or "Unable to render" in b.page_source)
    assert "Unable to render" not in browser.page_source
    shown = {element.get_attribute("data-path") or element.text
             for element in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
    spec = HTTP.get(f"{server.base_url}/openapi.json").json()
    assert spec["openapi"].startswith("3.1")
    assert {"/v1/search", "/v1/search/batch", "/v1/documents/{doc_id}"} <= shown
    assert shown == set(spec["paths"]), set(spec["paths"]) ^ shown
    scripts = [element.get_attribute("src") for element in browser.find_elements(By.TAG_NAME, "script")]
    assert all(src.startswith(server.base_url + "/docs-assets/") for src in scripts if src)  # nothing from a CDN


def test_a_search_link_runs_its_search_in_a_real_browser(browser, server, client: httpx.Client) -> None:
    """`/?q=...&k=...&mode=...` fills the form and searches; a search made on the page is put in
    the URL, so it can be linked and reloaded."""
    from urllib.parse import parse_qs, quote, urlsplit

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 60)
    browser.get(f"{server.base_url}/")
    browser.execute_script(f"sessionStorage.setItem('espn-api-key', '{API_KEY}')")
    browser.get(f"{server.base_url}/?q={quote('ocean tides')}&k=3&mode=hybrid")
    wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "li.result")) == 3)
    assert browser.find_element(By.ID, "query").get_attribute("value") == "ocean tides"
    assert browser.find_element(By.ID, "mode").get_attribute("value") == "hybrid"
    expected = client.post("/v1/search", json={"query": "ocean tides", "k": 3, "mode": "hybrid"}).json()["results"]
    ids = "return [...document.querySelectorAll('li.result')].map(r => r.dataset.id)"
    assert browser.execute_script(ids) == [hit["id"] for hit in expected]

    query = browser.find_element(By.ID, "query")
    query.clear()
    query.send_keys(QUERY)
    browser.find_element(By.ID, "search-button").click()
    wait.until(lambda b: parse_qs(urlsplit(b.current_url).query).get("q") == [QUERY])
    assert parse_qs(urlsplit(browser.current_url).query) == {"q": [QUERY], "k": ["3"], "mode": ["hybrid"]}
