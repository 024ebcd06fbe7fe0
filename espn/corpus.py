"""Streaming readers for corpora, queries and qrels: BEIR JSON lines (plain or .gz) and TSV.

Nothing here holds a corpus in memory: `iter_corpus` yields one document at a time.
Errors carry `file:line` so a user can find the bad line in a multi-GB file.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import logging
from pathlib import Path
from typing import IO, Any, Iterator, Mapping

from .errors import CorpusError, InvalidParameterError
from .ids import id_problem, quote_id
from .metadata import check_metadata
from .untrusted import check_json_depth

__all__ = ["CorpusDocument", "iter_corpus", "read_queries", "read_qrels", "detect_format", "passage_text",
           "passage_line", "PASSAGE_JOINER", "COLBERT_TITLE_JOINER", "COLBERT_FAMILY", "MAX_TITLE_JOINER_CHARS",
           "default_title_joiner", "check_title_joiner", "index_title_joiner"]

log = logging.getLogger(__name__)


#: What joins a passage's title to its text in the string the encoder sees, where the index
#: says nothing else: the default of the generic and ColBERTer encoders, and the joiner of every
#: index built before the joiner was recorded (`index_title_joiner`).
PASSAGE_JOINER = ". "
#: The default of ColBERT-family models: PyLate's and Sentence Transformers' BEIR evaluation give
#: the model `title + " " + text`, so an index built with it holds the vectors their index holds.
COLBERT_TITLE_JOINER = " "
#: Encoder kinds whose default joiner is COLBERT_TITLE_JOINER.
COLBERT_FAMILY = ("colbert", "multivector")
#: The longest joiner `--title-joiner` takes (it is part of every titled passage the model reads).
MAX_TITLE_JOINER_CHARS = 16


def passage_text(title: str, text: str, joiner: str = PASSAGE_JOINER) -> str:
    """Title and text joined by `joiner` (the index's, `index_title_joiner`); the text alone without a title."""
    return f"{title}{joiner}{text}" if title else text


def default_title_joiner(encoder_kind: str) -> str:
    """The joiner a new index of this encoder kind uses unless told: a space for ColBERT-family
    models (their libraries' BEIR evaluation), ". " for the others."""
    return COLBERT_TITLE_JOINER if encoder_kind in COLBERT_FAMILY else PASSAGE_JOINER


def check_title_joiner(joiner: str) -> str:
    """`--title-joiner` as given, or InvalidParameterError naming it: at most MAX_TITLE_JOINER_CHARS
    characters, no line breaks (a title that ends a line is another passage layout)."""
    if not isinstance(joiner, str) or len(joiner) > MAX_TITLE_JOINER_CHARS or any(c in joiner for c in "\r\n"):
        raise InvalidParameterError(f"--title-joiner must be a string of at most {MAX_TITLE_JOINER_CHARS} characters "
                                    f"without line breaks, got {joiner!r}")
    return joiner


def index_title_joiner(manifest: Mapping[str, Any]) -> str:
    """The joiner an index's passages were encoded with: its manifest's `passage.title_joiner`,
    or PASSAGE_JOINER for an index built before the joiner was recorded."""
    joiner = (manifest.get("passage") or {}).get("title_joiner")
    return joiner if isinstance(joiner, str) else PASSAGE_JOINER


def passage_line(title: str, text: str, metadata: dict | None) -> str:
    """A document's line of docs.jsonl: title, text and (when it has any) metadata, as JSON."""
    return json.dumps({"title": title, "text": text, **({"metadata": metadata} if metadata else {})},
                      ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class CorpusDocument:
    line: int
    doc_id: str
    title: str
    text: str
    metadata: dict[str, Any] | None = None  # the line's "metadata" object (checked by check_metadata)

    @property
    def full_text(self) -> str:
        """Title and text joined by PASSAGE_JOINER (`passage_text` takes an index's own joiner)."""
        return passage_text(self.title, self.text)


def _open_text(path: Path) -> IO[str]:
    try:
        raw: IO[bytes] = gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")  # type: ignore[assignment]
    except OSError as exc:
        raise CorpusError(f"{path}: cannot open: {exc.strerror or exc}") from exc
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict", newline="\n")


def detect_format(path: Path) -> str:
    """'jsonl' or 'tsv', from the extension, else from the first non-blank character."""
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    if name.endswith((".tsv", ".txt")):
        return "tsv"
    with _open_text(path) as f:
        for line in f:
            if line.strip():
                return "jsonl" if line.lstrip().startswith("{") else "tsv"
    return "jsonl"


def _iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    number = 0
    try:
        with _open_text(path) as f:
            for number, line in enumerate(f, start=1):
                yield number, line
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path}:{number + 1}: not valid UTF-8 ({exc.reason})") from exc
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise CorpusError(f"{path}:{number + 1}: cannot read: {exc}") from exc


def _parse(path: Path, number: int, line: str, fmt: str, kind: str,
           keep_empty: bool = False) -> tuple[str, str, str]:
    """-> (id, title, text) or raise CorpusError naming file:line."""
    doc_id, title, text, _ = _parse_with_metadata(path, number, line, fmt, kind, keep_empty)
    return doc_id, title, text


def _parse_with_metadata(path: Path, number: int, line: str, fmt: str, kind: str,
                         keep_empty: bool = False) -> tuple[str, str, str, dict[str, Any] | None]:
    """-> (id, title, text, metadata or None) or raise CorpusError naming file:line."""
    where = f"{path}:{number}"
    metadata = None
    if fmt == "jsonl":
        check_json_depth(line, where, error=CorpusError)  # before the parser, which recurses
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorpusError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise CorpusError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        doc_id = obj.get("_id", obj.get("id"))
        title, text = obj.get("title") or "", obj.get("text")
        if doc_id is None or (isinstance(doc_id, str) and not doc_id.strip()):
            raise CorpusError(f"{where}: missing '_id'")
        if not isinstance(doc_id, (str, int)) or isinstance(doc_id, bool):
            raise CorpusError(f"{where}: '_id' must be a string")
        if text is None or not isinstance(text, str) or not isinstance(title, str):
            raise CorpusError(f"{where}: 'text' (and 'title', if present) must be strings")
        doc_id = str(doc_id)
        if kind == "corpus" and obj.get("metadata") is not None:
            try:
                metadata = check_metadata(obj["metadata"]) or None
            except ValueError as exc:
                raise CorpusError(f"{where}: {exc}") from None
    else:
        parts = line.rstrip("\r\n").split("\t")
        if len(parts) < 2:
            raise CorpusError(f"{where}: expected 'id<TAB>text', found no tab")
        doc_id, title, text = parts[0], "", "\t".join(parts[1:]) if kind == "query" else parts[1]
        if kind == "corpus" and len(parts) >= 3:  # id<TAB>text<TAB>title, as BEIR's TSV export
            title = parts[2]
        if not doc_id.strip():
            raise CorpusError(f"{where}: empty id")
    if kind == "corpus":
        problem = id_problem(doc_id)  # the rule every write applies: ids are exact UTF-8 bytes
        if problem is not None:
            raise CorpusError(f"{where}: document id {quote_id(doc_id)} {problem}")
    if kind == "query" and not keep_empty and not (title.strip() or text.strip()):
        raise CorpusError(f"{where}: {kind} {doc_id!r} has no text")
    # A document without text is kept (real corpora have them): it is indexed with no
    # BOW vectors, can be fetched by id, and the build warns once with a count.
    return doc_id, title, text, metadata


def iter_corpus(path: Path, skip_bad: bool = False) -> Iterator[CorpusDocument]:
    """Documents in file order. Bad lines raise CorpusError, or are logged and skipped with skip_bad."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    fmt = detect_format(path)
    skipped = 0
    for number, line in _iter_lines(path):
        if not line.strip():
            continue
        try:
            doc_id, title, text, metadata = _parse_with_metadata(path, number, line, fmt, "corpus")
        except CorpusError as exc:
            if not skip_bad:
                raise
            skipped += 1
            log.warning("skipped %s", exc)
            continue
        yield CorpusDocument(number, doc_id, title, text, metadata)
    if skipped:
        log.warning("%s: skipped %d bad line(s)", path, skipped)


def read_queries(path: Path, keep_empty: bool = False) -> list[tuple[str, str]]:
    """(query_id, text) pairs: BEIR queries.jsonl or id<TAB>text. Queries are few, so a list.

    keep_empty: a query without text is kept (for a search to refuse on its own, naming its
    id) instead of refusing the whole file."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: no such file")
    fmt = detect_format(path)
    queries = []
    for number, line in _iter_lines(path):
        if line.strip():
            query_id, title, text = _parse(path, number, line, fmt, "query", keep_empty)
            queries.append((query_id, f"{title} {text}".strip()))
    if not queries:
        raise CorpusError(f"{path}: no queries")
    return queries


def read_qrels(path: Path) -> dict[str, dict[str, int]]:
    """BEIR qrels TSV (query-id, corpus-id, score; header optional) or TREC qrels (qid 0 docid rel)."""
    path = Path(path)
    qrels: dict[str, dict[str, int]] = {}
    for number, line in _iter_lines(path):
        parts = line.split()
        if not parts or (number == 1 and not parts[-1].lstrip("-").isdigit()):
            continue  # blank line or header
        if len(parts) == 4:
            parts = [parts[0], parts[2], parts[3]]
        if len(parts) != 3 or not parts[2].lstrip("-").isdigit():
            raise CorpusError(f"{path}:{number}: expected 'query-id corpus-id score'")
        qrels.setdefault(parts[0], {})[parts[1]] = int(parts[2])
    if not qrels:
        raise CorpusError(f"{path}: no judgements")
    return qrels
