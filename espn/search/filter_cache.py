"""Filters compiled for one generation and kept, least recently used out first.

A compiled filter is the bitmap of its matches (live ones only) plus, when it fits the
cache's budget, the matches' own IVF (`espn.search.filtered.subset_ivf`); too large to copy,
it keeps the bitmap and probes the full index by the same rule.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InvalidParameterError
from ..filters import FilterCache, canonical_filter, compile_filter, parse_filter
from .context import SearchContext
from .filtered import FilteredDocs, matches_per_list, subset_ivf

__all__ = ["CompiledFilters"]


class CompiledFilters:
    """The compiled filters of one generation, within `max_bytes` (masks and sub-indexes)."""

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidParameterError(f"filter_cache_bytes must be an integer >= 0, got {max_bytes!r}")
        self.cache: FilterCache[str, FilteredDocs] = FilterCache(max_bytes, lambda f: f.nbytes)

    def compiled(self, context: SearchContext, filter: Any) -> FilteredDocs | None:
        """A filter validated against the index's fields and compiled (cached per distinct filter).

        None for no filter (and for `{}`); a filter every document satisfies is searched unfiltered.
        Raises FilterError (an InvalidParameterError) naming the problem.
        """
        if filter is None:
            return None
        node = parse_filter(filter, context.metadata.schema)
        if node is None:
            return None
        key = canonical_filter(filter)
        found = self.cache.get(key)
        if found is not None:
            return found
        mask = compile_filter(node, context.metadata)
        if context.live is not None:  # deleted and replaced documents match nothing
            mask &= context.live
        matches = int(np.count_nonzero(mask))
        if matches == context.live_count:  # searched unfiltered; kept to report the count
            compiled = FilteredDocs(mask, matches, context.list_sizes, None)
        elif matches * (context.ann.code_size + 8) + mask.nbytes <= self.cache.max_bytes:
            sub, counts = subset_ivf(context.ann, mask)
            compiled = FilteredDocs(mask, matches, counts, sub)
        else:  # too large to copy: the bitmap over the full index, probed by the same rule
            compiled = FilteredDocs(mask, matches, matches_per_list(context.ann, mask), None)
        self.cache.put(key, compiled)
        return compiled
