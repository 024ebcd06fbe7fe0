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
import errno
import json
import logging
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..corpus import passage_text
from ..errors import IndexCorruptError, InvalidParameterError, storage_full
from ..index import fsync_path, sha256_file
from .config import TOKENIZER_NAME, TextConfig
from .query import LexicalQuery

__all__ = ["TextDocument", "LexicalHits", "TextIndex", "TextWriter", "build_text_index", "engine_files",
           "check_files", "ENGINE", "FIELD_DOC", "FIELD_BODY"]

log = logging.getLogger(__name__)

ENGINE = "tantivy"
FIELD_DOC = "doc_number"
FIELD_BODY = "body"
#: Below this many allowed documents a restricted search asks the engine for exactly those
#: (a term set on the doc-number field); above it, it reads deeper into the ranking instead.
TERM_SET_MAX = 20_000
_SEGMENT_FILE = re.compile(r"^([0-9a-f]{32})\.")


@dataclasses.dataclass(frozen=True)
class TextDocument:
    doc_number: int
    title: str
    text: str


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


def _schema() -> Any:
    import tantivy

    builder = tantivy.SchemaBuilder()
    builder.add_unsigned_field(FIELD_DOC, stored=False, indexed=True, fast=True)
    builder.add_text_field(FIELD_BODY, stored=False, tokenizer_name=TOKENIZER_NAME, index_option="position")
    return builder.build()


def _open(directory: Path, config: TextConfig) -> Any:
    import tantivy

    try:
        index = tantivy.Index.open(str(directory))
    except (ValueError, OSError) as exc:
        raise IndexCorruptError(f"{directory}: unreadable full-text index ({exc})") from None
    index.register_tokenizer(TOKENIZER_NAME, config.analyzer())
    return index


def _document(doc: TextDocument) -> Any:
    import tantivy

    if isinstance(doc.doc_number, bool) or not isinstance(doc.doc_number, (int, np.integer)) or doc.doc_number < 0:
        raise InvalidParameterError(f"doc_number must be an integer >= 0, got {doc.doc_number!r}")
    out = tantivy.Document()
    out.add_unsigned(FIELD_DOC, int(doc.doc_number))
    out.add_text(FIELD_BODY, passage_text(doc.title, doc.text))
    return out


def engine_files(directory: Path, meta: Mapping[str, Any] | None = None) -> list[str]:
    """The files a committed state needs: meta.json and every file of the segments it names
    (the engine's lock and bookkeeping files are not part of the index). meta: the parsed
    meta.json to list the files of (default: the directory's)."""
    if meta is None:
        meta = json.loads((Path(directory) / "meta.json").read_text(encoding="utf-8"))
    segments = {s["segment_id"].replace("-", ""): s for s in meta["segments"]}
    names = ["meta.json"]
    for name in sorted(os.listdir(directory)):
        match = _SEGMENT_FILE.match(name)
        if match is None or match.group(1) not in segments:
            continue
        deletes = segments[match.group(1)].get("deletes")
        if name.endswith(".del") and (deletes is None or name != f"{match.group(1)}.{deletes['opstamp']}.del"):
            continue  # an older deletion file of the segment
        names.append(name)
    missing = [s for s in segments if not any(n.startswith(s) for n in names)]
    if missing:
        raise FileNotFoundError(f"{directory}: no files for segment(s) {', '.join(missing)}")
    return names


def check_files(directory: Path, files: Mapping[str, Mapping[str, Any]], full: bool) -> None:
    """Sizes (and with `full` sha256) of a text directory against its recorded entries."""
    for name, expected in files.items():
        path = Path(directory) / name
        if not path.is_file():
            raise IndexCorruptError(f"{path}: missing")
        if path.stat().st_size != expected["bytes"]:
            raise IndexCorruptError(f"{path}: {path.stat().st_size} bytes, expected {expected['bytes']}")
        if full and expected.get("sha256") and sha256_file(path) != expected["sha256"]:
            raise IndexCorruptError(f"{path}: checksum mismatch (corrupted)")


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
    import tantivy

    config = config.validate()
    directory = Path(directory)
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    index = tantivy.Index(_schema(), path=str(directory))
    index.register_tokenizer(TOKENIZER_NAME, config.analyzer())
    writer = index.writer(heap_size=heap_bytes, num_threads=threads)
    count = 0
    for doc in documents:
        writer.add_document(_document(doc))
        count += 1
    writer.commit()
    writer.wait_merging_threads()
    _tidy(directory)
    for name in os.listdir(directory):
        fsync_path(directory / name)
    fsync_path(directory)
    return text_section(config, count)


def text_section(config: TextConfig, documents: int) -> dict[str, Any]:
    import tantivy

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
            self._index = _open(self.directory, config)
        except IndexCorruptError as exc:
            if "ReadOnlyFilesystem" not in str(exc) and "PermissionDenied" not in str(exc):
                raise
            # The engine takes a lock file beside the index even to read it: on a read-only mount
            # (a served copy, a follower's volume) read through links from a writable place.
            self._shadow = _shadow_of(self.directory)
            self._index = _open(self._shadow, config)
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
        import tantivy

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
        import tantivy

        quoted = words.replace("\\", " ").replace('"', " ")
        try:
            return self._index.parse_query(f'"{quoted}"', [FIELD_BODY])
        except ValueError:
            return tantivy.Query.boolean_query(
                [(tantivy.Occur.Must, tantivy.Query.term_query(self._schema, FIELD_BODY, t)) for t in terms])

    def compile(self, query: LexicalQuery, constraints_only: bool = False) -> Any | None:
        """The engine query of a parsed query (None when no clause leaves a term to look for)."""
        import tantivy

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
        import tantivy

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
        import tantivy

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
        import tantivy

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
        import tantivy

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


def _io_error(exc: ValueError, what: str, directory: Path, room_bytes: int) -> Exception:
    """A Tantivy error as the library's: a full disk is a StorageFullError, another I/O failure
    an OSError (the writer answers both as a failed write), anything else stays what it was.

    A failure in Tantivy's indexing thread reaches Python only as "An index writer was killed
    ... (io::Error most likely)", without its cause: it counts as a full disk when the
    filesystem has less free than `room_bytes` (what the writer flushes at once) or 1% of it."""
    full = storage_full(exc, what)
    if full is not None:
        return full
    message = str(exc)
    if "IO error" not in message and "io::Error" not in message:
        return exc
    stat = os.statvfs(directory)
    if stat.f_bavail * stat.f_frsize < max(room_bytes, stat.f_blocks * stat.f_frsize // 100):
        return storage_full(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory)), what) or exc
    return OSError(errno.EIO, f"{what}: {exc}")


def _shadow_of(directory: Path) -> Path:
    """A private temporary directory of symbolic links to `directory`'s index files."""
    import tempfile

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


class TextWriter:
    """The single writer of a live index's text side.

    `work` is private to the writer; `published` is the directory of the last published
    generation (the base's `text/` at first). Opening rebuilds `work` from `published` by
    hard links, so what a crashed writer committed but never published is gone.
    """

    def __init__(self, work: Path, published: Path, config: TextConfig, heap_bytes: int = 64 << 20,
                 restore: bool = True) -> None:
        """restore=False: `work` is known to hold exactly `published` already (this writer's own
        last publish), so it is reopened as it is."""
        self.work, self.config = Path(work), config
        if restore or not (self.work / "meta.json").is_file():
            restore_work(self.work, Path(published))
        self._index = _open(self.work, config)
        self._writer = self._index.writer(heap_size=heap_bytes, num_threads=1)
        self._heap_bytes = heap_bytes

    def apply(self, adds: Sequence[TextDocument], deletes: Sequence[int] | np.ndarray) -> None:
        """Delete the doc numbers `deletes`, add `adds`, and commit (not yet published)."""
        import tantivy

        numbers = [int(n) for n in np.asarray(deletes, dtype=np.int64).tolist()]
        try:
            if numbers:
                self._writer.delete_documents_by_query(
                    tantivy.Query.term_set_query(self._index.schema, FIELD_DOC, numbers))
            for doc in adds:
                self._writer.add_document(_document(doc))
            self._writer.commit()
        except ValueError as exc:  # Tantivy reports I/O failures as ValueError("An IO error occurred: ...")
            raise self._io_error(exc) from exc

    def _io_error(self, exc: ValueError) -> Exception:
        return _io_error(exc, f"the full-text index in {self.work}", self.work, 2 * self._heap_bytes)

    def publish(self, dest: Path, previous: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """Hard-link the committed state into the new directory `dest` (created whole by a
        rename, fsynced) and return its file entries {name: {bytes, sha256}}. Files already in
        `previous` (the last generation's entries) keep their sha256: segment files never change.
        """
        dest = Path(dest)
        staging = dest.with_name(dest.name + ".partial")
        for _ in range(100):  # a background merge may retire files between listing and linking
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
            raw = (self.work / "meta.json").read_bytes()
            try:
                names = engine_files(self.work, json.loads(raw))
                for name in names[1:]:
                    os.link(self.work / name, staging / name)
            except FileNotFoundError:
                continue
            with open(staging / "meta.json", "wb") as f:  # the very meta.json the files were listed from
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            break
        else:
            raise IndexCorruptError(f"{self.work}: could not take a consistent copy of the text index")
        entries = {}
        for name in names:
            size = (staging / name).stat().st_size
            known = (previous or {}).get(name)
            if known is not None and known["bytes"] == size and name != "meta.json":
                entries[name] = {"bytes": size, "sha256": known["sha256"]}
            else:
                entries[name] = {"bytes": size, "sha256": sha256_file(staging / name)}
        fsync_path(staging)
        os.replace(staging, dest)
        fsync_path(dest.parent)
        self.collect_garbage()
        return entries

    def collect_garbage(self) -> None:
        """Remove from the work directory the segment files no commit names any more and the
        engine does not manage (the ones restored from a published generation)."""
        managed_path = self.work / ".managed.json"
        managed = set(json.loads(managed_path.read_text())) if managed_path.is_file() else set()
        try:
            live = set(engine_files(self.work))
        except FileNotFoundError:
            return
        for name in os.listdir(self.work):
            if _SEGMENT_FILE.match(name) and name not in live and name not in managed:
                (self.work / name).unlink(missing_ok=True)

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer, self._index = self._writer, None, None
            try:
                writer.wait_merging_threads()
            except ValueError as exc:  # a merge that failed, or the writer killed by a failed write
                raise self._io_error(exc) from exc

    def __enter__(self) -> "TextWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def restore_work(work: Path, published: Path) -> None:
    """Make `work` exactly the published generation's files (hard links; no engine bookkeeping)."""
    if work.exists():
        shutil.rmtree(work)
    staging = work.with_name(work.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    for name in engine_files(published):
        os.link(published / name, staging / name)
    os.replace(staging, work)
    fsync_path(work.parent)
