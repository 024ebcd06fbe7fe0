"""The full-text index: Tantivy (the Rust engine, through its Python bindings) over one field.

Each passage is indexed as one field, `passage_text(title, text)` analysed by the index's
`TextConfig`, with its doc number in a fast field. Search returns doc numbers and BM25
scores (Tantivy's: k1 = 1.2, b = 0.75, idf = ln(1 + (N − n + 0.5) / (n + 0.5))).

Generations. A directory of engine files is never changed once written: Tantivy writes
new segment files (and new `.del` files for deletions) and swaps its `meta.json` by
rename. `TextWriter` works in a private work directory and publishes each generation as
a new directory of hard links to exactly the files its `meta.json` names, so a reader
opened on generation N keeps seeing N whatever the writer does next; publishing costs a
few links, not a copy. After a crash the writer rebuilds its work directory from the last
published generation, which drops whatever an unpublished one added.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import tantivy

from ..corpus import passage_text
from ..errors import IndexCorruptError
from ..files.durable import fsync_path
from .config import TOKENIZER_NAME, TextConfig
from .query import LexicalQuery
from .schema import (ENGINE, FIELD_BODY, FIELD_DOC, TERM_SET_MAX, TextDocument, check_files, engine_files, open_index,
                     schema, to_document)
from .writer import TextWriter

__all__ = ["TextDocument", "LexicalHits", "TextIndex", "TextWriter", "build_text_index", "engine_files",
           "check_files", "ENGINE", "FIELD_DOC", "FIELD_BODY"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EngineClause:
    """One clause as the engine runs it: `terms` are the analysed words (space-joined for a
    phrase); [query_start, query_end) is where it was written in the query."""

    occur: str
    terms: str
    query_start: int
    query_end: int
    query: Any


@dataclasses.dataclass(frozen=True)
class LexicalHits:
    """One query's ranked hits: doc_numbers [n] int64, scores [n] float32 (BM25, descending)."""

    doc_numbers: np.ndarray
    scores: np.ndarray

    @classmethod
    def empty(cls) -> "LexicalHits":
        return cls(np.zeros(0, np.int64), np.zeros(0, np.float32))

    def __len__(self) -> int:
        return len(self.doc_numbers)


def _tidy(directory: Path) -> None:
    """Leave only the index's own files (no engine locks or bookkeeping) in a finished directory."""
    keep = set(engine_files(directory))
    for name in os.listdir(directory):
        if name not in keep:
            (Path(directory) / name).unlink()


def build_text_index(directory: Path, documents: Iterable[TextDocument], config: TextConfig,
                     heap_bytes: int = 256 << 20, threads: int = 1) -> dict[str, Any]:
    """Index `documents` into a new directory; returns the manifest's `text` section.

    One engine commit at the end; the directory then holds only the files of that commit.
    """
    config = config.validate()
    directory = Path(directory)
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    index = tantivy.Index(schema(), path=str(directory))
    index.register_tokenizer(TOKENIZER_NAME, config.analyzer())
    writer = index.writer(heap_size=heap_bytes, num_threads=threads)
    count = 0
    for doc in documents:
        writer.add_document(to_document(doc))
        count += 1
    writer.commit()
    writer.wait_merging_threads()
    _tidy(directory)
    for name in os.listdir(directory):
        fsync_path(directory / name)
    fsync_path(directory)
    return text_section(config, count)


def text_section(config: TextConfig, documents: int) -> dict[str, Any]:
    return {"engine": ENGINE, "engine_version": getattr(tantivy, "__version__", "?"), "analyzer": config.to_json(),
            "fields": "title + text", "documents": documents, "directory": "text"}


class TextIndex:
    """One generation of the full-text index, opened read-only. Thread-safe: a search
    releases the GIL while the engine runs."""

    def __init__(self, directory: Path, config: TextConfig) -> None:
        self.directory = Path(directory)
        self.config = config
        self._shadow: Path | None = None
        try:
            self._index = open_index(self.directory, config)
        except IndexCorruptError as exc:
            if "ReadOnlyFilesystem" not in str(exc) and "PermissionDenied" not in str(exc):
                raise
            # The engine takes a lock file beside the index even to read it: on a read-only mount
            # (a served copy, a follower's volume) read through links from a writable place.
            self._shadow = _shadow_of(self.directory)
            self._index = open_index(self._shadow, config)
        self._index.config_reader(reload_policy="manual")  # pinned: never follows later commits
        self._searcher = self._index.searcher()
        self._schema = self._index.schema
        self._analyzer = config.analyzer()

    @property
    def num_documents(self) -> int:
        """Documents searchable in this generation (deleted ones excluded)."""
        return int(self._searcher.num_docs)

    def analyze(self, text: str) -> list[str]:
        """The index terms of `text` (the analyzer the passages went through)."""
        return list(self._analyzer.analyze(text))

    def clauses(self, query: LexicalQuery, constraints_only: bool = False) -> list[EngineClause]:
        """The engine clauses of a parsed query, in query order (clauses whose words are all
        stop words vanish).

        Plain words become optional term clauses, each distinct term once, so a bag of words
        scores as BM25 sums it; phrases and multi-term required/excluded words become phrases.
        constraints_only: only the required and excluded clauses (to test candidates against).
        """
        out: list[EngineClause] = []
        seen: set[str] = set()
        for clause in query.clauses:
            if constraints_only and clause.occur == "should":
                continue
            terms = self.analyze(clause.text)
            if not terms:
                continue
            if clause.occur == "should" and not clause.phrase:
                for term in terms:
                    if term not in seen:
                        seen.add(term)
                        out.append(EngineClause("should", term, clause.start, clause.end,
                                                tantivy.Query.term_query(self._schema, FIELD_BODY, term)))
                continue
            if len(terms) == 1:
                sub = tantivy.Query.term_query(self._schema, FIELD_BODY, terms[0])
            else:
                sub = self._phrase(clause.text, terms)
            out.append(EngineClause(clause.occur, " ".join(terms), clause.start, clause.end, sub))
        return out

    def _phrase(self, words: str, terms: list[str]) -> Any:
        """The phrase query of `words` (simple syntax only). The engine's parser keeps the
        positions stop words leave empty; should it refuse the text, every term is required."""
        quoted = words.replace("\\", " ").replace('"', " ")
        try:
            return self._index.parse_query(f'"{quoted}"', [FIELD_BODY])
        except ValueError:
            return tantivy.Query.boolean_query(
                [(tantivy.Occur.Must, tantivy.Query.term_query(self._schema, FIELD_BODY, t)) for t in terms])

    def compile(self, query: LexicalQuery, constraints_only: bool = False) -> Any | None:
        """The engine query of a parsed query (None when no clause leaves a term to look for)."""
        occurs = {"should": tantivy.Occur.Should, "must": tantivy.Occur.Must, "must_not": tantivy.Occur.MustNot}
        clauses = self.clauses(query, constraints_only)
        subqueries = [(occurs[c.occur], c.query) for c in clauses]
        if all(c.occur == "must_not" for c in clauses):
            if constraints_only and clauses:  # only exclusions: everything else satisfies them
                return tantivy.Query.boolean_query([(tantivy.Occur.Must, tantivy.Query.all_query()), *subqueries])
            return None
        return tantivy.Query.boolean_query(subqueries)

    def search(self, query: LexicalQuery, limit: int, allowed: np.ndarray | None = None) -> LexicalHits:
        """The top `limit` by BM25 among the documents `allowed` [N] bool admits (None: all).

        Exact: never fewer than `limit` while more allowed documents match. Up to TERM_SET_MAX
        allowed documents the engine is asked for exactly them; above, the ranking is read
        deeper until enough allowed ones are found.
        """
        compiled = self.compile(query)
        if compiled is None or limit <= 0:
            return LexicalHits.empty()
        if allowed is None:
            return self._top(compiled, limit)
        allowed_count = int(np.count_nonzero(allowed))
        if allowed_count == 0:
            return LexicalHits.empty()
        if allowed_count <= TERM_SET_MAX:
            numbers = np.flatnonzero(allowed).tolist()
            only = tantivy.Query.const_score_query(tantivy.Query.term_set_query(self._schema, FIELD_DOC, numbers), 0.0)
            hits = self._top(tantivy.Query.boolean_query([(tantivy.Occur.Must, compiled), (tantivy.Occur.Must, only)]),
                             limit)
            return _keep(hits, allowed, limit)
        fetch = limit + 16
        if allowed_count < len(allowed):
            fetch = int(math.ceil(limit * len(allowed) / allowed_count * 1.5)) + 16
        while True:
            hits = self._top(compiled, fetch)
            kept = _keep(hits, allowed, limit)
            if len(kept) >= limit or len(hits) < fetch:
                return kept
            fetch *= 4

    def _top(self, query: Any, limit: int) -> LexicalHits:
        hits = self._searcher.search(query, limit, count=False).hits
        if not hits:
            return LexicalHits.empty()
        numbers = self._searcher.fast_field_values(FIELD_DOC, [address for _, address in hits])
        return LexicalHits(np.asarray(numbers, dtype=np.int64), np.asarray([score for score, _ in hits], np.float32))

    def satisfying(self, query: LexicalQuery, doc_numbers: np.ndarray) -> np.ndarray:
        """[len(doc_numbers)] bool: which documents meet the query's required and excluded clauses."""
        doc_numbers = np.asarray(doc_numbers, dtype=np.int64)
        if not query.constrained or len(doc_numbers) == 0:
            return np.ones(len(doc_numbers), dtype=bool)
        constraints = self.compile(query, constraints_only=True)
        if constraints is None:  # every constrained clause was stop words
            return np.ones(len(doc_numbers), dtype=bool)
        only = tantivy.Query.term_set_query(self._schema, FIELD_DOC, doc_numbers.tolist())
        found = self._top(tantivy.Query.boolean_query([(tantivy.Occur.Must, constraints), (tantivy.Occur.Must, only)]),
                          len(doc_numbers))
        return np.isin(doc_numbers, found.doc_numbers)

    def term_scores(self, query: LexicalQuery, doc_number: int) -> list[tuple[EngineClause, float]]:
        """The clauses (terms, phrases) of the query that match one document, each with its BM25
        contribution; they add up to the document's lexical score."""
        only = tantivy.Query.const_score_query(tantivy.Query.term_query(self._schema, FIELD_DOC, int(doc_number)), 0.0)
        out = []
        for clause in self.clauses(query):
            if clause.occur == "must_not":
                continue
            hits = self._searcher.search(tantivy.Query.boolean_query(
                [(tantivy.Occur.Must, clause.query), (tantivy.Occur.Must, only)]), 1, count=False).hits
            if hits:
                out.append((clause, float(hits[0][0])))
        return out

    def highlights(self, query: LexicalQuery, title: str, text: str) -> list[tuple[int, int]]:
        """Character spans of `passage_text(title, text)` that match a query term."""
        compiled = self.compile(query)
        if compiled is None:
            return []
        generator = tantivy.SnippetGenerator.create(self._searcher, compiled, self._schema, FIELD_BODY)
        body = passage_text(title, text)
        generator.set_max_num_chars(len(body) + 1)
        doc = tantivy.Document()
        doc.add_text(FIELD_BODY, body)
        snippet = generator.snippet_from_doc(doc)
        offset = body.find(snippet.fragment()) if snippet.fragment() else 0
        return [(offset + r.start, offset + r.end) for r in snippet.highlighted()]

    def close(self) -> None:
        self._searcher = None
        self._index = None
        if self._shadow is not None:
            shutil.rmtree(self._shadow, ignore_errors=True)
            self._shadow = None


def _shadow_of(directory: Path) -> Path:
    """A private temporary directory of symbolic links to `directory`'s index files."""
    shadow = Path(tempfile.mkdtemp(prefix="espn-text-"))
    for name in engine_files(directory):
        os.symlink(directory.absolute() / name, shadow / name)
    return shadow


def _keep(hits: LexicalHits, allowed: np.ndarray, limit: int) -> LexicalHits:
    numbers = hits.doc_numbers
    ok = numbers < len(allowed)
    ok[ok] = allowed[numbers[ok]]
    where = np.flatnonzero(ok)[:limit]
    return LexicalHits(numbers[where], hits.scores[where])
