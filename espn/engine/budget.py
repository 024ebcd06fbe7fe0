"""The work budget of one request: refuse up front what would hold a search thread for seconds.

Work is queries x max(k, rerank_count, prefetch_k): the candidates the pipeline keeps,
reads and scores per query. The answer's size is estimated as hits x bytes per hit, with
the index's mean passage size added per hit when the text is asked for.
"""

from __future__ import annotations

from ..errors import OverBudgetError
from ..params import SearchParams

__all__ = ["check_budget", "HIT_BYTES"]

HIT_BYTES = 160  # one hit's JSON without text: id, three scores, keys and punctuation


def check_budget(params: SearchParams, queries: int, num_documents: int, text_bytes: float, return_text: bool,
                 *, max_work: int, max_response_bytes: int) -> None:
    """Raise OverBudgetError naming the limit when the request is over its budget."""
    per_query = max(params.k, params.rerank_count, params.wave_size if params.prefetch else 0)
    work = queries * per_query
    if work > max_work:
        raise OverBudgetError(f"request too large: {queries} queries x max(k, rerank_count, prefetch_k) {per_query} = "
                              f"{work} candidates, over the budget of {max_work} (ESPN_MAX_REQUEST_WORK); "
                              "send fewer queries or smaller k/rerank_count/prefetch_k")
    hits = queries * min(params.k, num_documents)
    estimate = hits * (HIT_BYTES + (text_bytes if return_text else 0.0))
    if estimate > max_response_bytes:
        raise OverBudgetError(f"response too large: {hits} hits{' with text' if return_text else ''} come to about "
                              f"{estimate / 1e6:.1f} MB, over {max_response_bytes / 1e6:.1f} MB "
                              "(ESPN_MAX_RESPONSE_BYTES); ask for fewer queries, a smaller k, or no return_text")
