"""The framework retrievers of `espn_client` against a real `espn serve` of the sample index.

LangChain's own standard retriever suite (`langchain-tests`' RetrieversIntegrationTests), and
for each framework: the documents it returns are what the HTTP API returns for the same query,
parameters and filter (ids, scores, text, the stored metadata, explanations), sync and async,
with the framework's own filter syntax translated to espn's.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from conftest import CLIENT_API_KEY
from helpers import HTTP_TIMEOUT_S

# Haystack sends usage telemetry unless told not to; this machine is offline, and tests send nothing.
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")

langchain_core = pytest.importorskip("langchain_core", reason="pip install -e './clients/python[langchain]'")
from langchain_tests.integration_tests import RetrieversIntegrationTests  # noqa: E402
from llama_index.core.vector_stores import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters  # noqa: E402
from haystack import Pipeline  # noqa: E402

from espn_client import AsyncClient, Client  # noqa: E402
from espn_client import haystack as espn_haystack  # noqa: E402
from espn_client import langchain as espn_langchain  # noqa: E402
from espn_client import llama_index as espn_llama_index  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs"
AUTH = {"Authorization": f"Bearer {CLIENT_API_KEY}"}
QUERY = "what causes ocean tides"
#: One filter in espn's language and in each framework's.
METADATA_FILTER = {"and": [{"topic": {"in": ["oceans", "weather"]}}, {"year": {"gte": 2000}}]}
LLAMA_FILTERS = MetadataFilters(filters=[MetadataFilter(key="topic", operator=FilterOperator.IN,
                                                        value=["oceans", "weather"]),
                                         MetadataFilter(key="year", operator=FilterOperator.GTE, value=2000)],
                                condition=FilterCondition.AND)
HAYSTACK_FILTERS = {"operator": "AND", "conditions": [
    {"field": "meta.topic", "operator": "in", "value": ["oceans", "weather"]},
    {"field": "meta.year", "operator": ">=", "value": 2000}]}


@pytest.fixture(scope="module")
def url(client_server) -> str:
    return client_server.base_url


@pytest.fixture(scope="module")
def raw(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers=AUTH, timeout=HTTP_TIMEOUT_S) as http:
        yield http


def expected(raw: httpx.Client, k: int, filter: Any = None, explain: bool = False, **params: Any) -> list[dict]:
    """What the HTTP API answers: per hit its id, score, text, title, scores, explanation and the
    stored metadata of its document (GET /v1/documents/{id})."""
    body = {"query": QUERY, "k": k, "return_text": True, **params}
    if filter is not None:
        body["filter"] = filter
    if explain:
        body["explain"] = True
    answer = raw.post("/v1/search", json=body)
    assert answer.status_code == 200, answer.text
    hits = answer.json()["results"]
    assert hits
    out = []
    for hit in hits:
        document = raw.get(f"/v1/documents/{hit['id']}").json()
        metadata = {**document["metadata"], "id": hit["id"], "score": hit["score"], "title": hit["title"],
                    "cls_score": hit["cls_score"], "bow_score": hit["bow_score"]}
        if explain:
            metadata["explanation"] = hit["explanation"]
        for name in ("dense_score", "lexical_score", "lexical_matches"):
            if name in hit:
                metadata[name] = hit[name]
        out.append({"id": hit["id"], "score": hit["score"], "text": hit["text"], "metadata": metadata})
    return out


# -- LangChain ---------------------------------------------------------------------------------

class TestLangChainStandardRetrieverSuite(RetrieversIntegrationTests):
    """langchain-tests' own retriever suite over a live server. Its async test is unmarked (LangChain
    runs it in pytest-asyncio's auto mode) and may not be overridden: the class marks every test,
    and pytest-asyncio's note on the sync ones is silenced."""

    pytestmark = [pytest.mark.asyncio,
                  pytest.mark.filterwarnings("ignore:.*marked with '@pytest.mark.asyncio' but it is not an async")]
    base_url = ""

    @pytest.fixture(autouse=True)
    def _server(self, url: str) -> None:
        type(self).base_url = url

    @property
    def retriever_constructor(self) -> type[espn_langchain.EspnRetriever]:
        return espn_langchain.EspnRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        # Fresh clients per retriever: an AsyncClient's pool belongs to the event loop it first ran on.
        return {"client": Client(self.base_url, api_key=CLIENT_API_KEY, timeout=HTTP_TIMEOUT_S),
                "async_client": AsyncClient(self.base_url, api_key=CLIENT_API_KEY, timeout=HTTP_TIMEOUT_S), "k": 4}

    @property
    def retriever_query_example(self) -> str:
        return QUERY


def _langchain_rows(documents: list[Any]) -> list[dict]:
    return [{"id": d.id, "score": d.metadata["score"], "text": d.page_content, "metadata": d.metadata}
            for d in documents]


def test_langchain_returns_what_http_returns(url: str, raw: httpx.Client) -> None:
    retriever = espn_langchain.EspnRetriever.from_url(url, api_key=CLIENT_API_KEY, k=5, filter=METADATA_FILTER)
    assert _langchain_rows(retriever.invoke(QUERY)) == expected(raw, 5, METADATA_FILTER)
    # Per call: k, the filter, explain and any search parameter pass through.
    assert _langchain_rows(retriever.invoke(QUERY, k=3, filter=None, explain=True, mode="hybrid")) == expected(
        raw, 3, explain=True, mode="hybrid")
    assert _langchain_rows(asyncio.run(retriever.ainvoke(QUERY, nprobe=2))) == expected(raw, 5, METADATA_FILTER, nprobe=2)
    only_sync = espn_langchain.EspnRetriever(client=Client(url, api_key=CLIENT_API_KEY, timeout=HTTP_TIMEOUT_S), k=2,
                                             fetch_metadata=False, return_text=False)
    documents = asyncio.run(only_sync.ainvoke(QUERY))  # LangChain's default: the sync search in a thread
    assert [d.id for d in documents] == [row["id"] for row in expected(raw, 2)]
    assert all(d.page_content == "" and "topic" not in d.metadata for d in documents)


# -- LlamaIndex --------------------------------------------------------------------------------

def _llama_rows(nodes: list[Any]) -> list[dict]:
    return [{"id": n.node.id_, "score": n.score, "text": n.node.text, "metadata": n.node.metadata} for n in nodes]


def test_llama_index_returns_what_http_returns(url: str, raw: httpx.Client) -> None:
    client = Client(url, api_key=CLIENT_API_KEY, timeout=HTTP_TIMEOUT_S)
    async_client = AsyncClient(url, api_key=CLIENT_API_KEY, timeout=HTTP_TIMEOUT_S)
    retriever = espn_llama_index.EspnRetriever(client, async_client=async_client, similarity_top_k=5,
                                               filters=LLAMA_FILTERS)
    want = expected(raw, 5, METADATA_FILTER)
    assert _llama_rows(retriever.retrieve(QUERY)) == want
    assert _llama_rows(asyncio.run(retriever.aretrieve(QUERY))) == want
    explained = espn_llama_index.EspnRetriever(client, similarity_top_k=3, explain=True,
                                               search_params={"mode": "hybrid"})
    nodes = explained.retrieve(QUERY)
    assert _llama_rows(nodes) == expected(raw, 3, explain=True, mode="hybrid")
    # espn's own keys stay out of the LLM's view of a node; the stored metadata and title stay in it.
    shown = nodes[0].node.get_content(metadata_mode="llm")
    assert "topic" in shown and "explanation" not in shown and "cls_score" not in shown


@pytest.mark.parametrize("llama, espn", [
    (MetadataFilters(filters=[MetadataFilter(key="topic", value="oceans")]), {"topic": "oceans"}),
    (MetadataFilters(filters=[MetadataFilter(key="topic", operator=FilterOperator.NIN, value=["oceans"]),
                              MetadataFilter(key="year", operator=FilterOperator.LT, value=2000)],
                     condition=FilterCondition.OR),
     {"or": [{"topic": {"not_in": ["oceans"]}}, {"year": {"lt": 2000}}]}),
    (MetadataFilters(filters=[MetadataFilter(key="tags", operator=FilterOperator.CONTAINS, value="classic"),
                              MetadataFilter(key="topic", operator=FilterOperator.NE, value="astronomy")]),
     {"and": [{"tags": "classic"}, {"not": {"topic": "astronomy"}}]}),
])
def test_llama_index_filters_select_what_espn_filters_select(url: str, raw: httpx.Client, llama: Any,
                                                             espn: dict) -> None:
    retriever = espn_llama_index.EspnRetriever(Client(url, api_key=CLIENT_API_KEY, timeout=HTTP_TIMEOUT_S),
                                               similarity_top_k=4, filters=llama, fetch_metadata=False)
    assert [n.node.id_ for n in retriever.retrieve(QUERY)] == [row["id"] for row in expected(raw, 4, espn)]


# -- Haystack ----------------------------------------------------------------------------------

def _haystack_rows(documents: list[Any]) -> list[dict]:
    return [{"id": d.id, "score": d.score, "text": d.content, "metadata": d.meta} for d in documents]


def test_haystack_returns_what_http_returns(url: str, raw: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESPN_API_KEY", CLIENT_API_KEY)  # the default Secret reads it
    retriever = espn_haystack.EspnRetriever(url=url, timeout=HTTP_TIMEOUT_S, top_k=5, filters=HAYSTACK_FILTERS)
    want = expected(raw, 5, METADATA_FILTER)
    assert _haystack_rows(retriever.run(query=QUERY)["documents"]) == want
    assert _haystack_rows(asyncio.run(retriever.run_async(query=QUERY))["documents"]) == want
    # Run-time filters replace the component's (FilterPolicy.REPLACE); top_k per run.
    ocean = {"field": "meta.topic", "operator": "==", "value": "oceans"}
    assert _haystack_rows(retriever.run(query=QUERY, filters=ocean, top_k=3)["documents"]) == expected(
        raw, 3, {"topic": "oceans"})
    # In a pipeline, and back from its serialised form.
    pipeline = Pipeline()
    pipeline.add_component("retriever", espn_haystack.EspnRetriever.from_dict(retriever.to_dict()))
    out = pipeline.run({"retriever": {"query": QUERY}})
    assert _haystack_rows(out["retriever"]["documents"]) == want
    explained = espn_haystack.EspnRetriever(url=url, timeout=HTTP_TIMEOUT_S, top_k=2, explain=True,
                                            search_params={"mode": "hybrid"}, filter={"topic": "oceans"})
    assert _haystack_rows(explained.run(query=QUERY)["documents"]) == expected(raw, 2, {"topic": "oceans"},
                                                                               explain=True, mode="hybrid")


def test_framework_filters_the_server_cannot_run_are_refused_before_any_request(url: str) -> None:
    with pytest.raises(ValueError, match="meta.<field>"):
        espn_haystack.EspnRetriever(url=url, timeout=HTTP_TIMEOUT_S).run(
            query=QUERY, filters={"field": "content", "operator": "==", "value": "x"})
    with pytest.raises(ValueError, match="text_match"):
        espn_llama_index.EspnRetriever(Client(url, timeout=HTTP_TIMEOUT_S), filters=MetadataFilters(filters=[
            MetadataFilter(key="topic", operator=FilterOperator.TEXT_MATCH, value="ocean")]))
    with pytest.raises(ValueError, match="client"):
        espn_langchain.EspnRetriever(k=3)


# -- the docs' examples ---------------------------------------------------------------------------

@pytest.mark.parametrize("page", ["guides/langchain.md", "guides/llama-index.md", "guides/haystack.md",
                                  "reference/python-client.md"])
def test_the_docs_python_examples_run(page: str, url: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Every ```python block of the page, run as it is against the test server (ESPN_URL, ESPN_API_KEY)."""
    monkeypatch.setenv("ESPN_URL", url)
    monkeypatch.setenv("ESPN_API_KEY", CLIENT_API_KEY)
    text = (DOCS / page).read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)
    assert blocks, page
    for block in blocks:
        exec(compile(block, f"{page} (example)", "exec"), {"__name__": "__docs_example__"})
    assert capsys.readouterr().out.strip()
