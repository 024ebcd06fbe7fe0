"""What goes in and out of an engine: search options and answers, an index's state, readiness.

Plain dataclasses over the library's own result types (`espn.results`): the server maps
them once to its HTTP models, and the CLI prints them, so a field is defined here or in
`espn.results` and nowhere else. Nothing here loads torch or FAISS.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping, Optional

from ..errors import InvalidParameterError
from ..results import Document, QueryResult

__all__ = ["SearchOptions", "QueryAnswer", "SearchAnswer", "Lifecycle", "IndexInfo", "IndexLimits", "Readiness", "SnapshotInfo"]

#: The fields of SearchOptions that choose a mode and its fusion (espn.params.HybridParams).
MODE_FIELDS = ("mode", "fusion", "lexical_k", "rrf_k", "mix_weight", "union", "syntax")
#: The fields of SearchOptions that are Searcher.params keywords.
PARAM_FIELDS = ("k", "nprobe", "prefetch_step", "prefetch_k", "rerank_count", "prefetch_waves", "prefetch",
                "first_stage", "first_stage_probe", "first_stage_candidates")


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """One request's search parameters; None keeps the index's default (its manifest's).

    filter:      a metadata filter (espn.filters), every hit satisfies it
    explain:     explain each re-ranked hit (per query token, what it matched)
    return_text: answer each hit's title and text beside its id
    """

    k: int = 10
    nprobe: Optional[int] = None
    prefetch_step: Optional[float] = None
    prefetch_k: Optional[int] = None
    rerank_count: Optional[int] = None
    prefetch_waves: Optional[int] = None
    prefetch: Optional[bool] = None
    first_stage: Optional[str] = None
    first_stage_probe: Optional[int] = None
    first_stage_candidates: Optional[int] = None
    mode: Optional[str] = None
    fusion: Optional[str] = None
    lexical_k: Optional[int] = None
    rrf_k: Optional[int] = None
    mix_weight: Optional[float] = None
    union: Optional[bool] = None
    syntax: Optional[str] = None
    filter: Optional[Mapping[str, Any]] = None
    explain: bool = False
    return_text: bool = False

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> "SearchOptions":
        """The options among `fields` (others, such as a request's query, are left out)."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in fields.items() if key in names and value is not None})

    def search_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of Searcher.params and Searcher.hybrid_params (None: the index's default)."""
        return {name: getattr(self, name) for name in (*PARAM_FIELDS, *MODE_FIELDS)}

    def mode_kwargs(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in MODE_FIELDS}


@dataclasses.dataclass(frozen=True)
class QueryAnswer:
    """One query's result and how the engine batched it."""

    result: QueryResult
    queue_ms: float  # from its arrival to the start of its search call
    batch_size: int  # queries in that call


@dataclasses.dataclass(frozen=True)
class SearchAnswer:
    """A request's answers in query order, and what failed alone.

    positions: where each of `answers` stands among the request's queries
    refused:   position -> the library's refusal of that query (isolated searches only)
    failed:    positions whose search failed for another reason (logged with its traceback)
    documents: the hits' passages by id (return_text); a hit deleted meanwhile has none
    engine:    the reader's I/O engine, for a searcher whose stats do not name it
    """

    answers: list[QueryAnswer]
    positions: list[int]
    refused: dict[int, InvalidParameterError]
    failed: list[int]
    documents: Optional[dict[str, Document]]
    engine: str


class Lifecycle(str, enum.Enum):
    """Where an index is in its life in this process (espn.engine.lifecycle moves it)."""

    CLOSED = "closed"  # held by name, not open (it opens at its next request)
    OPENING = "opening"
    WARMING = "warming"  # open, warming its caches and write path before it says ready
    READY = "ready"
    CLOSING = "closing"  # closing (idle, over the memory budget, shutting down): requests wait and reopen
    DELETING = "deleting"  # DELETE has begun: new requests get 404, those inside finish
    GONE = "gone"  # deleted (here or by another process): forgotten


@dataclasses.dataclass(frozen=True)
class IndexInfo:
    """One index as its registry sees it now (GET /v1/indexes, `espn stats`)."""

    name: str
    default: bool
    state: Lifecycle
    documents: int
    encoder: str
    generation: Optional[int] = None
    read_only: Optional[bool] = None
    memory_bytes: int = 0
    fit: Optional[Mapping[str, Any]] = None  # what its base is fitted on, a re-fit running (espn.live.status)

    @property
    def open(self) -> bool:
        return self.state in (Lifecycle.WARMING, Lifecycle.READY)


@dataclasses.dataclass(frozen=True)
class IndexLimits:
    """What an open index's requests may ask that depends on the index (beyond espn.engine.RULES).

    generation:    the generation these are of (they change only with it)
    nlist:         IVF lists: a search's nprobe is at most this
    first_stages:  the candidate generators it can use (ivf; centroids and union when built with them)
    filter_fields: its metadata fields by type (a filter names only these)
    """

    generation: int
    nlist: int
    first_stages: tuple[str, ...]
    filter_fields: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class Readiness:
    """Whether an index serves, and what it serves: its generation, reader, replication, partition."""

    ready: bool
    state: Lifecycle
    generation: Optional[int] = None
    read_only: Optional[bool] = None
    reader: Optional[dict[str, Any]] = None
    replication: Optional[dict[str, Any]] = None
    partition: Optional[dict[str, Any]] = None
    trust_remote_code: Optional[bool] = None


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot under an index's snapshot directory (the figures only for one just taken)."""

    name: str
    generation: int
    files: Optional[int] = None
    linked_bytes: Optional[int] = None
    copied_bytes: Optional[int] = None
