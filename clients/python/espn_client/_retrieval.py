"""What the three framework retrievers share: one search (with the documents' metadata) as
framework-neutral records, and the frameworks' filter syntaxes in espn's filter language.

A search hit carries id, scores and (with return_text) title and text, not the document's
metadata; with fetch_metadata the retriever reads each hit's document (GET /v1/documents/{id},
concurrently on the async path) and adds its metadata. A hit deleted in between keeps `{}`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from .async_client import AsyncClient
from .client import Client
from .models import Document, SearchResponse

__all__ = ["Record", "RetrievalOptions", "retrieve", "aretrieve", "and_filters", "filter_from_llama_index",
           "filter_from_haystack", "check_k", "ESPN_KEYS"]

#: The keys a retriever adds to each document's metadata, beside the document's own fields
#: (which they override on a clash): kept out of what an LLM or an embedder sees where the framework asks.
ESPN_KEYS = ("id", "score", "title", "cls_score", "bow_score", "dense_score", "lexical_score", "explanation",
             "lexical_matches")


@dataclasses.dataclass(frozen=True)
class Record:
    """One retrieved document: id, score, text ("" without return_text) and metadata."""

    id: str
    score: float
    text: str
    metadata: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class RetrievalOptions:
    """k results; filter in espn's language (None: none); params: other search parameters
    (mode, nprobe, fusion, ...); explain: each hit's explanation in its metadata (k <= 100);
    return_text: the text as the document's content; fetch_metadata: the stored metadata too."""

    k: int
    filter: Optional[dict[str, Any]] = None
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    explain: bool = False
    return_text: bool = True
    fetch_metadata: bool = True

    def search_kwargs(self) -> dict[str, Any]:
        return {**self.params, "k": self.k, "filter": self.filter, "return_text": self.return_text or None,
                "explain": self.explain or None}


def records(response: SearchResponse, documents: Mapping[str, Document]) -> list[Record]:
    out = []
    for hit in response.results:
        stored = documents.get(hit.id)
        metadata: dict[str, Any] = dict(stored.metadata) if stored is not None else {}
        metadata.update(id=hit.id, score=hit.score, cls_score=hit.cls_score, bow_score=hit.bow_score)
        title = hit.title if hit.title is not None else stored.title if stored is not None else None
        if title is not None:
            metadata["title"] = title
        for name in ("dense_score", "lexical_score"):
            if name in hit.model_fields_set:
                metadata[name] = getattr(hit, name)
        if hit.explanation is not None:
            metadata["explanation"] = hit.explanation.model_dump(mode="json", exclude_unset=True)  # as the server sent it
        if hit.lexical_matches is not None:
            metadata["lexical_matches"] = [m.model_dump(mode="json", exclude_unset=True) for m in hit.lexical_matches]
        out.append(Record(hit.id, hit.score, hit.text or "", metadata))
    return out


def retrieve(client: Client, query: str, options: RetrievalOptions) -> list[Record]:
    response = client.search(query, **options.search_kwargs())
    ids = [hit.id for hit in response.results]
    documents = client.get_documents(ids, missing_ok=True) if options.fetch_metadata else {}
    return records(response, documents)


async def aretrieve(client: AsyncClient, query: str, options: RetrievalOptions) -> list[Record]:
    response = await client.search(query, **options.search_kwargs())
    ids = [hit.id for hit in response.results]
    documents = await client.get_documents(ids, missing_ok=True) if options.fetch_metadata else {}
    return records(response, documents)


def and_filters(*filters: Optional[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """The filters that are given, all of them required (None if none is)."""
    given = [dict(f) for f in filters if f]
    if not given:
        return None
    return given[0] if len(given) == 1 else {"and": given}


# -- LlamaIndex's MetadataFilters ---------------------------------------------------------------
# Read by attribute (key, operator, value; filters, condition): this module imports no framework.

def _name(value: Any) -> str:
    return str(getattr(value, "value", value)).lower()


def _llama_one(item: Any) -> dict[str, Any]:
    if hasattr(item, "filters"):
        return filter_from_llama_index(item)
    key, operator, value = item.key, _name(getattr(item, "operator", "==")), item.value
    if operator == "==" or operator == "contains":  # on a list of keywords espn's equality is "contains"
        return {key: value}
    if operator == "!=":
        return {"not": {key: value}}
    bounds = {">": "gt", ">=": "gte", "<": "lt", "<=": "lte"}
    if operator in bounds:
        return {key: {bounds[operator]: value}}
    if operator == "in":
        return {key: {"in": list(value)}}
    if operator == "nin":
        return {key: {"not_in": list(value)}}
    if operator == "any":
        return {"or": [{key: v} for v in value]}
    if operator == "all":
        return {"and": [{key: v} for v in value]}
    if operator == "is_empty":
        return {"not": {key: {"exists": True}}}
    raise ValueError(f"filters: LlamaIndex operator {operator!r} has no espn equivalent "
                     "(espn filters: ==, !=, <, <=, >, >=, in, nin, contains, any, all, is_empty)")


def filter_from_llama_index(filters: Any) -> dict[str, Any]:
    """A LlamaIndex `MetadataFilters` as an espn filter ("and", "or"; "not" negates the conjunction)."""
    members = [_llama_one(item) for item in filters.filters]
    condition = _name(getattr(filters, "condition", None) or "and")
    if condition == "and":
        return members[0] if len(members) == 1 else {"and": members}
    if condition == "or":
        return {"or": members}
    if condition == "not":
        return {"not": members[0] if len(members) == 1 else {"and": members}}
    raise ValueError(f"filters: LlamaIndex condition {condition!r} has no espn equivalent (and, or, not)")


# -- Haystack 2's filter dictionaries -------------------------------------------------------------

def _haystack_field(field: Any) -> str:
    if not isinstance(field, str) or not field.startswith("meta."):
        raise ValueError(f"filters: field {field!r}: espn filters metadata fields only, named 'meta.<field>'")
    return field[len("meta."):]


def filter_from_haystack(filters: Mapping[str, Any]) -> dict[str, Any]:
    """A Haystack filter ({"field": "meta.x", "operator": "==", "value": ...} or
    {"operator": "AND"|"OR"|"NOT", "conditions": [...]}) as an espn filter."""
    operator = filters.get("operator")
    if "conditions" in filters:
        members = [filter_from_haystack(c) for c in filters["conditions"]]
        joined = members[0] if len(members) == 1 else {"and": members}
        if operator == "AND":
            return joined
        if operator == "OR":
            return {"or": members}
        if operator == "NOT":  # Haystack: not (all of them)
            return {"not": joined}
        raise ValueError(f"filters: logical operator {operator!r}; Haystack's are AND, OR, NOT")
    key, value = _haystack_field(filters.get("field")), filters.get("value")
    if operator in ("in", "not in"):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"filters: {operator!r} on {filters.get('field')!r} takes a list, got {value!r}")
        return {key: {"in" if operator == "in" else "not_in": list(value)}}
    if operator in ("==", "!=") and value is None:  # Haystack: the field is absent (==) or present (!=)
        present = {key: {"exists": True}}
        return present if operator == "!=" else {"not": present}
    if operator == "==":
        return {key: value}
    if operator == "!=":
        return {"not": {key: value}}
    bounds = {">": "gt", ">=": "gte", "<": "lt", "<=": "lte"}
    if operator in bounds:
        return {key: {bounds[operator]: value}}
    raise ValueError(f"filters: comparison operator {operator!r}; Haystack's are ==, !=, >, >=, <, <=, in, not in")


def check_k(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: a positive number of results, got {value!r}")
    return value
