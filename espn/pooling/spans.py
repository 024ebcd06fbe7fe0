"""Which passage text each stored BOW vector of a pooled index stands for, for explanations.

Reads the pooling groups every writer records beside pooled records (`espn.pooling.groups`)
and gives each stored vector the spans of the encoder vectors it merged. Documents whose
groups are not stored (an index built before the files existed, a base compaction carried
from one) take the older way: their passages are re-encoded and pooled again.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import numpy as np

from ..encoders.base import VectorSpans
from ..index import IndexDirectory
from .groups import PoolGroups, StoredPoolGroups, merge_group_spans
from ..generation.segments import LIVE_DIR, LiveView

__all__ = ["open_index_groups", "spans_from_groups"]

log = logging.getLogger(__name__)


def open_index_groups(index: IndexDirectory, view: LiveView | None) -> StoredPoolGroups:
    """The pooling groups of an index (its base) or of one generation of a live index.

    Under a view each part is mapped once per process and shared by every generation over
    the same base (segments never change); without one, the base's two files are mapped
    now (a few microseconds, no descriptor kept).
    """
    if view is None:
        return StoredPoolGroups([PoolGroups.open(index.path, index.num_documents)], [0])
    shared = view.shared
    base = shared.attached("pool-groups", lambda: PoolGroups.open(view.base.path, view.generation.base_documents),
                           lambda _: None)
    parts, firsts = [base], [0]
    for info in view.generation.segments:
        directory = view.root / LIVE_DIR / info.name
        parts.append(shared.attached(f"pool-groups:{info.name}:{info.first}",
                                     functools.partial(PoolGroups.open, directory, info.documents), lambda _: None))
        firsts.append(info.first)
    return StoredPoolGroups(parts, firsts)
def spans_from_groups(stored: StoredPoolGroups, numbers: np.ndarray, n_stored: np.ndarray,
                      source_spans: list[VectorSpans],
                      recompute: Callable[[list[int]], list[VectorSpans]]) -> list[VectorSpans]:
    """Spans of pooled records from their stored groups; `recompute(positions)` (re-encoding)
    for the documents whose groups are not stored or do not fit their record.

    numbers [n] doc numbers; n_stored [n] their stored vector counts; source_spans: per
    document, the spans of its encoder vectors (`Encoder.vector_spans`).
    """
    out: list[VectorSpans | None] = []
    missing: list[int] = []
    for position, (number, count, spans) in enumerate(zip(np.asarray(numbers).tolist(),
                                                          np.asarray(n_stored).tolist(), source_spans)):
        groups = stored.of(number)
        fits = (groups is not None and len(groups) == len(spans)
                and (int(groups.max()) + 1 if len(groups) else 0) == count)
        if groups is not None and len(groups) and not fits:
            log.warning("explain: the stored pooling groups of doc %d do not fit its record (%d groups for %d "
                        "encoder vectors, %d stored); re-encoding it", number, len(groups), len(spans), count)
        out.append(merge_group_spans(groups, spans) if fits and groups is not None else None)
        if out[-1] is None:
            missing.append(position)
    if missing:
        for position, spans in zip(missing, recompute(missing)):
            out[position] = spans
    return [spans if spans is not None else [] for spans in out]
