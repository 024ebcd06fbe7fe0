"""Per-query isolation: one query the library refuses costs only itself, and nothing else is hidden.

The CLI's `espn search` and the server's batched searches search many queries in one call.
When the library refuses that call (`InvalidParameterError`: a query too long, with no text
left...), each query is searched alone so that the refused ones can be told from the others.
Only a refusal is isolated: any other exception (a bug, a failed read, a closed index) is
not one query's fault and is raised, so that it reaches the caller as what it is (a 500 and
a traceback in the server's log, a traceback from the CLI) instead of being reported as a
bad query.

The server's micro-batcher searches several groups of queries (each with its own parameters)
in one call: `encode_together` encodes all their queries at once, and `search_isolated`
searches one group with that encoding and the same isolation, the shared encode in its stage
times. `sort_outcomes` sorts a batch's outcomes into the answered, the refused and the failed,
for the CLI's report and the server's response alike.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Generic, Mapping, Optional, Sequence, TypeVar, Union

from ..errors import InvalidParameterError
from ..results import QueryResult

if TYPE_CHECKING:  # the searcher and the encoders load torch and FAISS; this module must not (the CLI's parser)
    from ..encoders import QueryEmbeddings
    from .searcher import Searcher

__all__ = ["search_each", "Outcomes", "sort_outcomes", "SearchGroup", "encode_together", "search_isolated"]

T = TypeVar("T")
#: One group of a batched call: its query texts and its keyword arguments to `Searcher.search`.
SearchGroup = tuple[Sequence[str], Mapping[str, Any]]


def search_each(run: Callable[[list[int]], Sequence[T]], count: int, *,
                on_refusal: Callable[[int, InvalidParameterError], None] | None = None
                ) -> list[Union[T, InvalidParameterError]]:
    """Search `count` queries with `run(rows)` (rows: positions in 0..count-1; it returns one
    result per row, in order): all in one call, or, when the library refuses that call, each
    alone. Returns, per position, its result or the library's refusal of that query.

    on_refusal(row, refusal): called at each refusal as it happens; it may raise (a strict
    run ends at the first). Any exception other than InvalidParameterError is raised at once.

    >>> def run(rows):
    ...     if 1 in rows:
    ...         raise InvalidParameterError("query 1 has no text")
    ...     return [f"result {r}" for r in rows]
    >>> search_each(run, 3)
    ['result 0', InvalidParameterError('query 1 has no text'), 'result 2']
    """
    try:
        return list(run(list(range(count))))
    except InvalidParameterError as refused:
        if count == 1:
            if on_refusal is not None:
                on_refusal(0, refused)
            return [refused]
    outcomes: list[Union[T, InvalidParameterError]] = []
    for row in range(count):
        try:
            (one,) = run([row])
        except InvalidParameterError as refused:
            if on_refusal is not None:
                on_refusal(row, refused)
            outcomes.append(refused)
            continue
        outcomes.append(one)
    return outcomes


@dataclasses.dataclass
class Outcomes(Generic[T]):
    """A batch's outcomes sorted by kind, each kind by the query's position (in position order)."""

    answered: dict[int, T]
    refused: dict[int, InvalidParameterError]  # the library's refusal of that query
    #: not the query's fault (a bug, a failed read): the server hands a group's failure to each of its queries
    failed: dict[int, Exception]


def sort_outcomes(outcomes: Sequence[Union[T, Exception]]) -> Outcomes[T]:
    """Per position, a result, the library's refusal (InvalidParameterError) or another failure,
    sorted into `Outcomes`: what `search_each` returns, or the server's batcher hands back."""
    sorted_ = Outcomes[T]({}, {}, {})
    for row, one in enumerate(outcomes):
        if isinstance(one, InvalidParameterError):
            sorted_.refused[row] = one
        elif isinstance(one, Exception):
            sorted_.failed[row] = one
        else:
            sorted_.answered[row] = one
    return sorted_


def encode_together(searcher: "Searcher", groups: Sequence[SearchGroup]
                    ) -> tuple[list[Optional["QueryEmbeddings"]], float]:
    """The queries of several groups encoded in one call (one tokenise-and-encode instead of one
    per group): per group, its rows of that encoding, and the milliseconds it took. A group gets
    None when it is encoded at its own search instead: the only group, a lexical one (nothing to
    encode), or every group when the shared encode fails (each group's own search then reports
    its problem, on its own)."""
    started = time.perf_counter()
    shared: list[Optional["QueryEmbeddings"]] = [None] * len(groups)
    if len(groups) > 1:
        try:
            texts = [searcher.dense_queries(queries, params.get("mode"), params.get("syntax"))
                     for queries, params in groups]
            flat = [text for group in texts if group is not None for text in group]
            embeddings = searcher.encode(flat) if flat else None
        except Exception:  # noqa: BLE001 - not isolation: a bad group fails at its own search, on its own
            embeddings = None
        if embeddings is not None:
            start = 0
            for i, group_texts in enumerate(texts):
                if group_texts is not None:
                    shared[i] = embeddings[start:start + len(group_texts)]
                    start += len(group_texts)
    return shared, (time.perf_counter() - started) * 1000


def search_isolated(searcher: "Searcher", queries: Sequence[str], params: Mapping[str, Any], *,
                    embeddings: Optional["QueryEmbeddings"] = None, encode_ms: float = 0.0
                    ) -> list[Union[QueryResult, InvalidParameterError]]:
    """`searcher.search(queries, **params)` with per-query isolation (`search_each`): per query,
    its result or the library's refusal of it; any other failure is raised.

    embeddings: the group's rows of `encode_together`, used when the whole group is searched in
    one call (a query searched alone encodes itself); when every query is answered so, the shared
    encode's `encode_ms` stands in the stage times as stage "encode" (and in "total").
    """
    def run(picked: list[int]) -> list[QueryResult]:
        whole = len(picked) == len(queries)
        return searcher.search([queries[i] for i in picked], embeddings=embeddings if whole else None, **params)

    results = search_each(run, len(queries))
    answered = [r for r in results if not isinstance(r, InvalidParameterError)]
    if embeddings is not None and answered and len(answered) == len(queries):
        stage_ms = answered[0].stats.stage_ms  # the batch's results share one stage_ms dict
        stage_ms["encode"] = round(encode_ms, 3)
        stage_ms["total"] = round(stage_ms["total"] + encode_ms, 3)
    return results
