"""espn: multi-vector retrieval with the token-embedding table on SSD.

>>> from espn import Searcher                      # doctest: +SKIP
>>> Searcher.open("INDEX").search(["query"], k=10)  # doctest: +SKIP
"""

from .errors import DocumentNotFoundError, EspnError, IndexCorruptError, InvalidParameterError
from .params import SearchParams
from .results import Document, Hit, QueryResult, SearchStats
from .searcher import Searcher

__all__ = [
    "Searcher",
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
