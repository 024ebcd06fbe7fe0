"""Per-query isolation: one query the library refuses costs only itself, and nothing else is hidden.

The CLI's `espn search` and the server's batched searches search many queries in one call.
When the library refuses that call (`InvalidParameterError`: a query too long, with no text
left...), each query is searched alone so that the refused ones can be told from the others.
Only a refusal is isolated: any other exception (a bug, a failed read, a closed index) is
not one query's fault and is raised, so that it reaches the caller as what it is (a 500 and
a traceback in the server's log, a traceback from the CLI) instead of being reported as a
bad query.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar, Union

from ..errors import InvalidParameterError

__all__ = ["search_each"]

T = TypeVar("T")


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
