"""Queries longer than the model reads: the rule espn follows, and which queries it cut.

The rule is each model family's own, as its library encodes a query, so that a query is scored
as the model was trained and evaluated:

- ColBERT checkpoints (PyLate, colbert-ai, Sentence Transformers 6 `MultiVectorEncoder`) and the
  Hugging Face encoders **truncate**: a query is read up to the model's query length in tokens
  (its `query_length` or query expansion width, prompt and markers included; `query_max_length`
  for `hf:`), the rest is not read. PyLate, colbert-ai and Sentence Transformers do the same;
  splitting a query and merging the parts' vectors would score a query the model never saw
  (MaxSim sums over query vectors, so the parts' vectors would add up).
- Page models (ColPali, ColQwen) read a query whole, as their processors do.

Nothing is refused for being long (a query is bounded by `MAX_QUERY_CHARS` before it is encoded):
a result says when its query was cut (`SearchStats.query_truncated`) and how many of its
characters the model read (`query_read_chars`), the same in the library, `espn search` and over
HTTP, which all call `Searcher.search`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import numpy as np

from ..encoders.base import QueryEmbeddings
from ..results import QueryResult

__all__ = ["LONG_QUERY_RULE", "mark_truncated", "read_chars"]

log = logging.getLogger(__name__)

#: What happens to a query longer than the model's query length (the family's own rule, above).
LONG_QUERY_RULE = "truncate"


def read_chars(encoder: Any, text: str) -> int | None:
    """How many characters of `text` the model read (the end of its last text token), None where
    the encoder cannot map its vectors to text (pooled query vectors)."""
    try:
        spans = encoder.vector_spans([text], is_query=True)[0]
    except NotImplementedError:
        return None
    ends = [end for vector in spans for _, end in vector]
    return max(ends) if ends else None


def mark_truncated(encoder: Any, queries: Sequence[str], embeddings: QueryEmbeddings,
                   results: list[QueryResult]) -> list[QueryResult]:
    """`results` with `query_truncated` (and `query_read_chars`) set on the queries the encoder cut;
    the others as they are. Costs nothing unless a query was cut."""
    flags = embeddings.truncated
    if flags is None or encoder is None or not bool(np.any(flags)):
        return results
    out = list(results)
    for row in np.flatnonzero(flags).tolist():
        read = read_chars(encoder, queries[row])
        if read is not None and read >= len(queries[row].rstrip()):
            continue  # filled the query length exactly: every character was read
        out[row] = dataclasses.replace(out[row], stats=dataclasses.replace(out[row].stats, query_truncated=True,
                                                                            query_read_chars=read))
        log.debug("query %d truncated after %s of its %d characters", row, read, len(queries[row]))
    return out
