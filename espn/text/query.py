"""The query syntax of lexical and hybrid search, as users of a full-text engine expect it.

    ocean tides                 words: any may match; each matching word adds its BM25 score
    "ocean tides"               a phrase: the words adjacent, in this order
    +tides                      required: every hit contains it (a word or a "phrase")
    -moon                       excluded: no hit contains it (a word or a "phrase")

An operator counts only directly before a word or a quote (`+1`, `-"full moon"`); a lone
`+` or `-` between spaces is punctuation, as in "CTLA - 4". Everything else is text for
the analyzer: there is no field syntax, so no query can reach the engine's internal
fields. Mistakes raise `QuerySyntaxError` (an InvalidParameterError) naming the position.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from ..errors import InvalidParameterError

__all__ = ["Clause", "LexicalQuery", "QuerySyntaxError", "parse_query"]

Occur = Literal["should", "must", "must_not"]


class QuerySyntaxError(InvalidParameterError):
    """A query the syntax cannot read; `position` is the 0-based character offset of the problem."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(f"query: {message} at position {position}")
        self.position = position


@dataclasses.dataclass(frozen=True)
class Clause:
    """One operand: its words as written, whether quoted, and where it stands in the query
    ([start, end) covers the operator and the quotes)."""

    occur: Occur
    text: str
    phrase: bool
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class LexicalQuery:
    source: str
    clauses: tuple[Clause, ...]

    @property
    def constrained(self) -> bool:
        """Has required or excluded clauses (they restrict every hit, also in hybrid mode)."""
        return any(c.occur != "should" for c in self.clauses)

    def dense_text(self) -> str:
        """What the dense encoder should read: the words searched for, without the operators,
        the quotes and the excluded clauses."""
        return " ".join(c.text for c in self.clauses if c.occur != "must_not")


def parse_query(query: str) -> LexicalQuery:
    """Parse `query` (see the module doc). Raises QuerySyntaxError for an unclosed quote, an
    empty phrase, two operators in a row, or a query whose every clause is excluded."""
    clauses: list[Clause] = []
    i, n = 0, len(query)
    while i < n:
        if query[i].isspace():
            i += 1
            continue
        start = i
        occur: Occur = "should"
        if query[i] in "+-" and i + 1 < n and not query[i + 1].isspace():
            occur = "must" if query[i] == "+" else "must_not"
            i += 1
            if query[i] in "+-" and i + 1 < n and not query[i + 1].isspace():
                raise QuerySyntaxError(f"operator {query[i]!r} right after {query[start]!r}", i)
        elif query[i] in "+-":  # a lone operator is punctuation
            i += 1
            continue
        if query[i] == '"':
            close = query.find('"', i + 1)
            if close < 0:
                raise QuerySyntaxError("unclosed quote", i)
            text = query[i + 1 : close]
            if not text.strip():
                raise QuerySyntaxError("empty phrase", i)
            i = close + 1
            clauses.append(Clause(occur, text, True, start, i))
            continue
        while i < n and not query[i].isspace() and query[i] != '"':
            i += 1
        clauses.append(Clause(occur, query[start + (occur != "should") : i], False, start, i))
    if clauses and all(c.occur == "must_not" for c in clauses):
        raise QuerySyntaxError("the query only excludes (-); add a word to search for", clauses[0].start)
    return LexicalQuery(query, tuple(clauses))
