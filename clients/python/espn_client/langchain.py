"""`EspnRetriever` for LangChain: a `BaseRetriever` over `espn_client.Client` (and `AsyncClient`).

    pip install 'espn-client[langchain]'

    from espn_client import AsyncClient, Client
    from espn_client.langchain import EspnRetriever

    retriever = EspnRetriever(client=Client(URL), async_client=AsyncClient(URL), k=4, filter={"topic": "oceans"})
    docs = retriever.invoke("what causes ocean tides")            # or: await retriever.ainvoke(...)
    docs = retriever.invoke("tides", k=2, mode="hybrid")           # per call: k, filter, any search parameter

Each `Document` has the hit's id as `id`, its text as `page_content` (with return_text, the
default) and in `metadata` the document's stored metadata plus `id`, `score`, `title`,
`cls_score`, `bow_score` (and `explanation` with explain=True).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import ConfigDict, Field, model_validator

try:
    from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever
except ImportError as exc:  # an optional extra: say how to install it
    raise ImportError("espn_client.langchain needs LangChain: pip install 'espn-client[langchain]'") from exc

from ._retrieval import Record, RetrievalOptions, aretrieve, check_k, retrieve
from .async_client import AsyncClient
from .client import Client

__all__ = ["EspnRetriever"]

_OPTIONS = ("k", "filter", "explain", "return_text", "fetch_metadata")


class EspnRetriever(BaseRetriever):
    """Documents from an espn server for a query.

    client / async_client: the sync and async clients (at least one; `from_url` makes both).
    Without async_client, `ainvoke` runs the sync search in a thread (LangChain's default).
    k: results; filter: espn's filter language (e.g. {"year": {"gte": 2000}});
    search_params: other parameters of the search API (mode, nprobe, rerank_count, fusion, ...);
    explain: each hit's explanation in its metadata (k <= 100); return_text: the text as
    page_content (else ""); fetch_metadata: the stored metadata too (one GET per hit).
    `invoke(query, k=..., filter=..., mode=...)` overrides any of them for one call."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    client: Optional[Client] = None
    async_client: Optional[AsyncClient] = None
    k: int = 4
    filter: Optional[dict[str, Any]] = None
    search_params: dict[str, Any] = Field(default_factory=dict)
    explain: bool = False
    return_text: bool = True
    fetch_metadata: bool = True

    @model_validator(mode="after")
    def _check(self) -> "EspnRetriever":
        if self.client is None and self.async_client is None:
            raise ValueError("EspnRetriever needs client=Client(URL) and/or async_client=AsyncClient(URL) "
                             "(or EspnRetriever.from_url(URL))")
        check_k("k", self.k)
        return self

    @classmethod
    def from_url(cls, base_url: str, *, api_key: Optional[str] = None, index: Optional[str] = None,
                 **kwargs: Any) -> "EspnRetriever":
        """A retriever with a sync and an async client of `base_url` (kwargs: the retriever's fields)."""
        return cls(client=Client(base_url, api_key=api_key, index=index),
                   async_client=AsyncClient(base_url, api_key=api_key, index=index), **kwargs)

    def _options(self, overrides: dict[str, Any]) -> RetrievalOptions:
        given = {name: overrides.pop(name) for name in _OPTIONS if name in overrides}
        return RetrievalOptions(
            k=check_k("k", given.get("k", self.k)), filter=given.get("filter", self.filter),
            params={**self.search_params, **overrides}, explain=given.get("explain", self.explain),
            return_text=given.get("return_text", self.return_text),
            fetch_metadata=given.get("fetch_metadata", self.fetch_metadata))

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                **kwargs: Any) -> list[Document]:
        if self.client is None:
            raise ValueError("EspnRetriever.invoke needs client=Client(URL); this one has only an async_client "
                             "(use ainvoke)")
        return [_document(r) for r in retrieve(self.client, query, self._options(dict(kwargs)))]

    async def _aget_relevant_documents(self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun,
                                       **kwargs: Any) -> list[Document]:
        if self.async_client is None:
            return await super()._aget_relevant_documents(query, run_manager=run_manager, **kwargs)
        return [_document(r) for r in await aretrieve(self.async_client, query, self._options(dict(kwargs)))]


def _document(record: Record) -> Document:
    return Document(id=record.id, page_content=record.text, metadata=record.metadata)
