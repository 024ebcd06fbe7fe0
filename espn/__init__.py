"""espn: multi-vector retrieval with the token-embedding table on SSD.

>>> from espn import Searcher                      # doctest: +SKIP
>>> Searcher.open("INDEX").search(["query"], k=10)  # doctest: +SKIP
>>> from espn import Index                         # doctest: +SKIP
>>> index = Index.create("NEW-INDEX")              # doctest: +SKIP
>>> index.add([{"id": "d1", "text": "The Moon pulls the oceans."}])  # doctest: +SKIP

Only the light names (errors, parameters, result types) load eagerly: `Searcher` and
`Index` (an index in this process that takes writes, espn.engine.embedded) pull in torch
and FAISS, so they load on first use. A process that only needs
`espn.errors` (the router, `espn --help`) never imports them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .errors import DocumentNotFoundError, EspnError, IndexCorruptError, InvalidParameterError
from .params import SearchParams
from .results import Document, Hit, QueryResult, SearchStats

if TYPE_CHECKING:
    from .engine.embedded import Index
    from .search.searcher import Searcher

__all__ = [
    "Searcher",
    "Index",
    "SearchParams",
    "Hit",
    "QueryResult",
    "SearchStats",
    "Document",
    "EspnError",
    "InvalidParameterError",
    "IndexCorruptError",
    "DocumentNotFoundError",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Index":
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as for Searcher, below
        # Lazy on purpose, as Searcher: torch and FAISS load with it.
        from .engine.embedded import Index

        return Index
    if name == "Searcher":
        # As the CLI does, before torch or FAISS load OpenMP (when they have not yet): idle threads
        # that spin starve the MaxSim kernel's own threads on a small machine. A user's value wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        # Lazy on purpose: Searcher loads torch and FAISS, and `import espn.errors` (the router,
        # `espn --help`) must not (tests/test_packaging.py checks it).
        from .search.searcher import Searcher

        return Searcher
    raise AttributeError(f"module 'espn' has no attribute {name!r}")
