"""Waves re-ranked early: read and scored on a prefetch worker while the ANN scan goes on.

The GPU path (`SearchContext.early_rerank`) and hybrid's lexical documents use them; the
worker both submits and waits, as ring-based engines require. A wave's failure reaches
the search through `finish`; an abandoned search `discard`s its waves.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future

import numpy as np

from ..maxsim import QueryScoring
from ..store import RecordBatch
from .context import SearchContext
from .scoring import score_pairs

__all__ = ["EarlyWave", "start_early_wave"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EarlyWave:
    """A wave re-ranked early: the (query, doc) keys it took and the worker reading and scoring them."""

    keys: np.ndarray
    future: Future
    owned: RecordBatch | None = None  # read before the wave: released by the worker, or here if it never ran

    def finish(self) -> tuple[tuple[int, int], np.ndarray]:
        """(bytes read, ios) and the wave's pair scores [2, len(keys)]; re-raises a worker failure."""
        cost, scores = self.future.result()
        return cost, scores

    def discard(self) -> None:
        """Wait for the wave without using it (its search failed), logging its own error."""
        if self.future.cancel():
            if self.owned is not None:
                self.owned.release()
        elif self.future.exception() is not None:
            log.warning("a prefetch wave failed while its search was being abandoned",
                        exc_info=self.future.exception())


def start_early_wave(context: SearchContext, keys: np.ndarray, n_docs: int, queries: QueryScoring,
                     records: RecordBatch | None = None) -> EarlyWave:
    """Read and re-rank the (query · n_docs + doc) `keys` on a worker while the ANN goes on.
    records: the wave's documents, read already (only scored here; the wave releases them,
    also when it is cancelled)."""
    docs = np.unique(keys % n_docs)

    def read_and_score() -> tuple[tuple[int, int], np.ndarray]:
        batch = context.reader.submit(docs).records() if records is None else records
        with batch:
            return (batch.bytes_read, batch.ios), score_pairs(context, queries, batch, keys, n_docs)

    return EarlyWave(keys, context.pool.submit(read_and_score), records)
