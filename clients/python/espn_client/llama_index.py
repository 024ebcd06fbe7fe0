"""`EspnRetriever` for LlamaIndex: a `BaseRetriever` over `espn_client.Client` (and `AsyncClient`).

    pip install 'espn-client[llama-index]'

    from espn_client import AsyncClient, Client
    from espn_client.llama_index import EspnRetriever
    from llama_index.core.vector_stores import MetadataFilter, MetadataFilters

    retriever = EspnRetriever(Client(URL), async_client=AsyncClient(URL), similarity_top_k=5,
                              filters=MetadataFilters(filters=[MetadataFilter(key="topic", value="oceans")]))
    nodes = retriever.retrieve("what causes ocean tides")          # or: await retriever.aretrieve(...)

Each `NodeWithScore` holds the hit's score and a `TextNode` whose `id_` is the hit's id, whose
text is the document's text (with return_text, the default) and whose metadata is the stored
metadata plus `id`, `score`, `title`, `cls_score`, `bow_score` (and `explanation` with
explain=True); espn's own keys are kept out of what the LLM and the embedder see.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

try:
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.callbacks import CallbackManager
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.core.vector_stores.types import MetadataFilters
except ImportError as exc:  # an optional extra: say how to install it
    raise ImportError("espn_client.llama_index needs LlamaIndex: pip install 'espn-client[llama-index]'") from exc

from ._retrieval import ESPN_KEYS, Record, RetrievalOptions, and_filters, aretrieve, check_k, filter_from_llama_index, retrieve
from .async_client import AsyncClient
from .client import Client

__all__ = ["EspnRetriever"]


class EspnRetriever(BaseRetriever):
    """Nodes from an espn server for a query.

    client: the sync client (None: only `aretrieve` works); async_client: the async one (None:
    `aretrieve` runs the sync search). similarity_top_k: results. filters: LlamaIndex
    `MetadataFilters` (==, !=, <, <=, >, >=, in, nin, contains, any, all, is_empty; and, or,
    not); filter: a filter in espn's own language; both given, both must hold. search_params:
    other parameters of the search API (mode, nprobe, fusion, ...). explain: each hit's
    explanation in its metadata (k <= 100); return_text: the text as the node's text;
    fetch_metadata: the stored metadata too (one GET per hit)."""

    def __init__(self, client: Optional[Client] = None, *, async_client: Optional[AsyncClient] = None,
                 similarity_top_k: int = 10, filters: Optional[MetadataFilters] = None,
                 filter: Optional[Mapping[str, Any]] = None, search_params: Optional[Mapping[str, Any]] = None,
                 explain: bool = False, return_text: bool = True, fetch_metadata: bool = True,
                 callback_manager: Optional[CallbackManager] = None, verbose: bool = False) -> None:
        if client is None and async_client is None:
            raise ValueError("EspnRetriever needs a Client and/or async_client=AsyncClient(URL)")
        super().__init__(callback_manager=callback_manager, verbose=verbose)
        self.client = client
        self.async_client = async_client
        self.options = RetrievalOptions(
            k=check_k("similarity_top_k", similarity_top_k),
            filter=and_filters(filter_from_llama_index(filters) if filters is not None else None, filter),
            params=dict(search_params or {}), explain=explain, return_text=return_text, fetch_metadata=fetch_metadata)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if self.client is None:
            raise ValueError("EspnRetriever.retrieve needs a Client; this one has only an async_client (use aretrieve)")
        return [_node(r) for r in retrieve(self.client, query_bundle.query_str, self.options)]

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if self.async_client is None:
            return self._retrieve(query_bundle)
        return [_node(r) for r in await aretrieve(self.async_client, query_bundle.query_str, self.options)]


def _node(record: Record) -> NodeWithScore:
    own = [key for key in ESPN_KEYS if key in record.metadata and key != "title"]
    node = TextNode(id_=record.id, text=record.text, metadata=record.metadata, excluded_llm_metadata_keys=own,
                    excluded_embed_metadata_keys=own)
    return NodeWithScore(node=node, score=record.score)
