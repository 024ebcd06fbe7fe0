"""`EspnRetriever` for Haystack 2: a `@component` over `espn_client.Client` (and `AsyncClient`).

    pip install 'espn-client[haystack]'

    from espn_client.haystack import EspnRetriever

    retriever = EspnRetriever(url=URL, top_k=5)           # the API key from ESPN_API_KEY, if set
    documents = retriever.run(query="what causes ocean tides",
                              filters={"field": "meta.topic", "operator": "==", "value": "oceans"})["documents"]

Each `Document` has the hit's id, score, text as `content` (with return_text, the default) and
in `meta` the stored metadata plus `id`, `score`, `title`, `cls_score`, `bow_score` (and
`explanation` with explain=True). Serialisable (`to_dict`/`from_dict`): the component holds
the URL and a `Secret` for the key, and opens its clients on first use.
"""

from __future__ import annotations

from typing import Any, Optional, Union

try:
    from haystack import Document, component, default_from_dict, default_to_dict
    from haystack.document_stores.types import FilterPolicy, apply_filter_policy
    from haystack.utils import Secret, deserialize_secrets_inplace
except ImportError as exc:  # an optional extra: say how to install it
    raise ImportError("espn_client.haystack needs Haystack: pip install 'espn-client[haystack]'") from exc

from ._core import DEFAULT_TIMEOUT_S
from ._retrieval import Record, RetrievalOptions, and_filters, aretrieve, check_k, filter_from_haystack, retrieve
from .async_client import AsyncClient
from .client import Client

__all__ = ["EspnRetriever"]


@component
class EspnRetriever:
    """Documents from an espn server for a query.

    url: the server; api_key: a Haystack `Secret` (default: ESPN_API_KEY if set); index: one
    index of a server that holds several (None: its default). top_k: results. filters: Haystack
    filters on `meta.<field>`, applied by filter_policy (REPLACE: run's filters replace these;
    MERGE: both hold). filter: a filter in espn's own language, always applied. search_params:
    other parameters of the search API (mode, nprobe, fusion, ...). explain: each hit's
    explanation in `meta` (top_k <= 100); return_text: the text as `content` (else None);
    fetch_metadata: the stored metadata too (one GET per hit). timeout: seconds per request."""

    def __init__(self, url: str, *, api_key: Secret = Secret.from_env_var("ESPN_API_KEY", strict=False),
                 index: Optional[str] = None, top_k: int = 10, filters: Optional[dict[str, Any]] = None,
                 filter_policy: Union[str, FilterPolicy] = FilterPolicy.REPLACE,
                 filter: Optional[dict[str, Any]] = None, search_params: Optional[dict[str, Any]] = None,
                 explain: bool = False, return_text: bool = True, fetch_metadata: bool = True,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.url = url
        self.api_key = api_key
        self.index = index
        self.top_k = check_k("top_k", top_k)
        self.filters = filters
        self.filter_policy = (filter_policy if isinstance(filter_policy, FilterPolicy)
                              else FilterPolicy.from_str(filter_policy))
        self.filter = filter
        self.search_params = dict(search_params or {})
        self.explain = explain
        self.return_text = return_text
        self.fetch_metadata = fetch_metadata
        self.timeout = timeout
        self._client: Optional[Client] = None
        self._async_client: Optional[AsyncClient] = None

    def to_dict(self) -> dict[str, Any]:
        return default_to_dict(self, url=self.url, api_key=self.api_key.to_dict(), index=self.index, top_k=self.top_k,
                               filters=self.filters, filter_policy=self.filter_policy.value, filter=self.filter,
                               search_params=self.search_params, explain=self.explain, return_text=self.return_text,
                               fetch_metadata=self.fetch_metadata, timeout=self.timeout)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EspnRetriever":
        deserialize_secrets_inplace(data["init_parameters"], keys=["api_key"])
        return default_from_dict(cls, data)

    def _key(self) -> Optional[str]:
        value = self.api_key.resolve_value()
        return str(value) if value else None

    def _options(self, filters: Optional[dict[str, Any]], top_k: Optional[int]) -> RetrievalOptions:
        chosen = apply_filter_policy(self.filter_policy, self.filters, filters)
        return RetrievalOptions(
            k=check_k("top_k", top_k if top_k is not None else self.top_k),
            filter=and_filters(filter_from_haystack(chosen) if chosen else None, self.filter),
            params=self.search_params, explain=self.explain, return_text=self.return_text,
            fetch_metadata=self.fetch_metadata)

    @component.output_types(documents=list[Document])
    def run(self, query: str, filters: Optional[dict[str, Any]] = None,
            top_k: Optional[int] = None) -> dict[str, list[Document]]:
        """The top_k documents for `query` (filters: Haystack filters, applied by filter_policy)."""
        if self._client is None:
            self._client = Client(self.url, api_key=self._key(), index=self.index, timeout=self.timeout)
        return {"documents": [_document(r) for r in retrieve(self._client, query, self._options(filters, top_k))]}

    @component.output_types(documents=list[Document])
    async def run_async(self, query: str, filters: Optional[dict[str, Any]] = None,
                        top_k: Optional[int] = None) -> dict[str, list[Document]]:
        """`run` on the event loop (an AsyncClient, opened on first use)."""
        if self._async_client is None:
            self._async_client = AsyncClient(self.url, api_key=self._key(), index=self.index, timeout=self.timeout)
        records = await aretrieve(self._async_client, query, self._options(filters, top_k))
        return {"documents": [_document(r) for r in records]}


def _document(record: Record) -> Document:
    return Document(id=record.id, content=record.text if record.text else None, meta=record.metadata,
                    score=record.score)
