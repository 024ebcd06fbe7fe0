"""What a lexical or hybrid query means: plain text by default, a small syntax on request.

Plain (`syntax="plain"`, the default): the query is text. Every character is searched as
part of a word or ignored as punctuation by the analyzer; nothing is an operator, so no
query is ever a syntax error, and the dense encoder reads the query exactly as typed.
Users paste questions, titles, citations, code and log lines: `"`, `-`, `+`, `:` and
`AND` are text in them.

Simple (`syntax="simple"`, opt-in), as Elasticsearch's `simple_query_string` reads it:

    ocean tides                 words: any may match; each matching word adds its BM25 score
    "ocean tides"               a phrase: the words adjacent, in this order
    +tides                      required: every hit contains it (a word or a "phrase")
    -moon                       excluded: no hit contains it (a word or a "phrase")

An operator counts only directly before a word or a quote (`+1`, `-"full moon"`); a lone
`+` or `-` between spaces is punctuation, as in "CTLA - 4". It is lenient: an unclosed
quote, an empty phrase or an operator before another operator degrades to text, and
`LexicalQuery.ignored` says what was read as text instead (the response reports it).
There is no field syntax, so no query can reach the engine's internal fields.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from ..choices import SYNTAXES
from ..errors import InvalidParameterError
from ..params import check_syntax

__all__ = ["Clause", "LexicalQuery", "QuerySyntaxError", "SYNTAXES", "check_syntax", "parse_query"]

Occur = Literal["should", "must", "must_not"]
_WORDS = re.compile(r"\S+")


class QuerySyntaxError(InvalidParameterError):
    """Kept for callers that catch it; no syntax raises it any more (both are lenient)."""

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
    """A parsed query. ignored: what the simple syntax read as text instead of as syntax,
    one line each ("unclosed quote at position 12: read as text")."""

    source: str
    clauses: tuple[Clause, ...]
    syntax: str = "plain"
    ignored: tuple[str, ...] = ()

    @property
    def constrained(self) -> bool:
        """Has required or excluded clauses (they restrict every hit, also in hybrid mode)."""
        return any(c.occur != "should" for c in self.clauses)

    def dense_text(self) -> str:
        """What the dense encoder reads: the query as typed (plain); the words searched for,
        without the operators, quotes and excluded clauses (simple; as typed if none)."""
        if self.syntax == "plain":
            return self.source
        return " ".join(c.text for c in self.clauses if c.occur != "must_not") or self.source


def parse_query(query: str, syntax: str = "plain") -> LexicalQuery:
    """Read `query` in `syntax` (see the module doc). Never raises for the query's text."""
    if check_syntax(syntax) == "plain":  # each run of non-space characters: its words, optional
        return LexicalQuery(query, tuple(Clause("should", m.group(), False, m.start(), m.end())
                                         for m in _WORDS.finditer(query)))
    return _parse_simple(query)


def _parse_simple(query: str) -> LexicalQuery:
    clauses: list[Clause] = []
    ignored: list[str] = []
    i, n = 0, len(query)
    while i < n:
        if query[i].isspace():
            i += 1
            continue
        start = i
        occur: Occur = "should"
        if query[i] in "+-" and i + 1 < n and not query[i + 1].isspace():
            if query[i + 1] in "+-":  # `+-word`, `--x`: the first one is punctuation
                ignored.append(f"operator {query[i]!r} at position {i} before another operator: read as text")
                i += 1
                continue
            occur = "must" if query[i] == "+" else "must_not"
            i += 1
        elif query[i] in "+-":  # a lone operator is punctuation
            i += 1
            continue
        if query[i] == '"':
            close = query.find('"', i + 1)
            if close < 0:  # the quote is punctuation; what follows is read on as usual
                ignored.append(f"unclosed quote at position {i}: read as text")
                i += 1
                if occur != "should":
                    ignored.append(f"operator {query[start]!r} at position {start} before an unclosed quote: "
                                   "read as text")
                continue
            text = query[i + 1 : close]
            i = close + 1
            if not text.strip():
                ignored.append(f"empty phrase at position {start}")
                continue
            clauses.append(Clause(occur, text, True, start, i))
            continue
        while i < n and not query[i].isspace() and query[i] != '"':
            i += 1
        clauses.append(Clause(occur, query[start + (occur != "should") : i], False, start, i))
    # A query that only excludes ranks nothing on the lexical side (as simple_query_string,
    # every document without those words matches); hybrid ranks by the dense side among them.
    return LexicalQuery(query, tuple(clauses), "simple", tuple(ignored))
