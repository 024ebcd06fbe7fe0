"""Page corpora for visual document search: page images from a folder, a PDF or a JSONL manifest.

    folder/                 every PNG, JPEG, WebP and PDF under it, walked in sorted order
    report.pdf              each page rendered at `dpi`
    scan.png, scan          one image (a file without a page's suffix is read by its first bytes)
    pages.jsonl             {"_id": ..., "image": "scans/a.png" or "doc.pdf#2", "metadata": {...}}

Ids are stable: the path relative to the root for an image ("scans/a.png"), `path#N` for
page N (1-based) of a PDF, the record's `_id` for a JSONL. Everything read here comes from
outside and follows espn.untrusted: files are bounded in size before they are opened, only
regular files are read, links and JSONL paths never lead out of the root, and an image's
or a page's pixel size is checked from its header before any pixel is decoded (so a
decompression bomb costs a header read). A bad page (an unreadable or truncated image, a
file that is not what its extension says, an encrypted or broken PDF, a page over the
pixel bound, an image type that is not read, such as TIFF) is a one-line CorpusError naming
the file and page, or, with `skip_bad`, a warning and a count, as `espn.corpus` does for text
lines. Images are decoded by espn.pages.decode, PDFs read by espn.pages.pdf.

Nothing holds a corpus: `iter_pages` yields one page at a time, and a PDF is read through
PDFium from its file (not loaded whole) and rendered one page at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from PIL import Image

from ..errors import CorpusError, InvalidParameterError
from ..ids import id_problem, quote_id
from ..metadata import check_metadata
from ..untrusted import MAX_JSON_DEPTH, check_json_depth, inside_root, json_depth, open_regular, regular_file
from .decode import (IMAGE_FORMATS, MAX_IMAGE_BYTES, SIGNATURE_BYTES, UNSUPPORTED_IMAGE_SUFFIXES, decode_image,
                     one_line, sniff_kind)
from .pdf import PDF_SUFFIX, PdfFile

__all__ = ["Page", "is_page_corpus", "iter_pages", "count_pages", "no_pages_error", "PDF_SUFFIX", "MIN_DPI", "MAX_DPI",
           "DEFAULT_DPI", "TEXT_CORPUS_SUFFIXES"]

log = logging.getLogger(__name__)

#: Rendering resolution of PDF pages. 144 dpi puts an A4 page at 1191x1684 px, above the
#: 448-896 px that ColPali-class processors resize to; 36 is a thumbnail, 600 a print scan.
MIN_DPI, MAX_DPI, DEFAULT_DPI = 36, 600, 144
#: A JSONL record is an id, a path and metadata (itself at most 16 KiB as JSON).
MAX_LINE_BYTES = 1 << 20
#: Folders nested deeper than this are refused (each level is an open directory scan).
MAX_DEPTH = 64
#: Suffixes of text corpora: a file given alone with one of these is never taken for a page by its content.
TEXT_CORPUS_SUFFIXES = frozenset({".jsonl", ".json", ".tsv", ".txt", ".csv", ".gz"})
#: The suffix a page format found by its first bytes is decoded as (a key of IMAGE_FORMATS).
_FORMAT_SUFFIX = {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp", "PDF": PDF_SUFFIX}



@dataclasses.dataclass(frozen=True)
class Page:
    """One page of a page corpus."""

    id: str  # "scan.png", "reports/a.pdf#3" (1-based page), or the JSONL record's "_id"
    source: str  # the file's path relative to the corpus root, "/"-separated
    page_number: int  # 1-based; 1 for an image file
    metadata: dict[str, Any]  # the JSONL record's "metadata" (checked by check_metadata), else {}
    image: Image.Image  # mode "RGB", at most MAX_SIDE_PX a side and MAX_PIXELS in all


class _Format(NamedTuple):
    """How a file is read: `kind` "image" (decoded as `suffix`, a key of IMAGE_FORMATS), "pdf", or
    "unsupported" (an image type espn does not read, `label` its name)."""

    kind: str
    suffix: str
    label: str


def _format(name: str) -> _Format | None:
    """How a file is read, from its suffix (case-insensitive); None: not a page (passed over in a folder)."""
    suffix = os.path.splitext(name)[1].lower()
    if suffix in IMAGE_FORMATS:
        return _Format("image", suffix, IMAGE_FORMATS[suffix])
    if suffix == PDF_SUFFIX:
        return _Format("pdf", suffix, "PDF")
    if suffix in UNSUPPORTED_IMAGE_SUFFIXES:
        return _Format("unsupported", suffix, UNSUPPORTED_IMAGE_SUFFIXES[suffix])
    return None


def _kind(name: str) -> str | None:
    """'image', 'pdf', 'unsupported' or None, from the suffix (case-insensitive)."""
    found = _format(name)
    return None if found is None else found.kind


def _lone_format(path: Path) -> _Format | None:
    """How a corpus given as one file is read: by its name where the name is a page's, else (unless
    the name is a text corpus's) by its first bytes, so that a scan without its suffix is a page
    and a TIFF is refused as one, not read as text. None: a text corpus or a JSONL."""
    by_name = _format(path.name)
    if by_name is not None or path.suffix.lower() in TEXT_CORPUS_SUFFIXES:
        return by_name
    try:
        fd, _ = open_regular(path.resolve(), str(path), error=CorpusError)
    except CorpusError:
        return None  # the reader that opens it says why, in its own words
    with os.fdopen(fd, "rb") as f:
        found = sniff_kind(f.read(SIGNATURE_BYTES))
    if found is None:
        return None
    if found in _FORMAT_SUFFIX:
        return _Format("pdf" if found == "PDF" else "image", _FORMAT_SUFFIX[found], found)
    return _Format("unsupported", path.suffix.lower(), found)


def _unsupported(shown: str, label: str) -> CorpusError:
    return CorpusError(f"{shown}: refused, a {label} image; pages are read from PNG, JPEG, WebP and PDF files "
                       "(convert it to one of them)")


def _check_dpi(dpi: int) -> int:
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not MIN_DPI <= dpi <= MAX_DPI:
        raise InvalidParameterError(f"dpi must be an integer in [{MIN_DPI}, {MAX_DPI}], got {dpi!r}")
    return dpi


def _read_image(real: Path, shown: str, suffix: str) -> Image.Image:
    fd, info = open_regular(real, shown, error=CorpusError)
    with os.fdopen(fd, "rb") as fp:
        if info.st_size > MAX_IMAGE_BYTES:
            raise CorpusError(f"{shown}: refused, {info.st_size} bytes (at most {MAX_IMAGE_BYTES} for an image)")
        return decode_image(fp, shown, suffix)


# --- walking a folder ---------------------------------------------------------------------------------------


def _walk(root: Path, relative: str = "", depth: int = 0) -> Iterator[tuple[str, Path | CorpusError]]:
    """(relative path, real path to open or the CorpusError that refuses it) of every image and PDF
    under `root`, in sorted order of names at each level (so the order of the sorted relative paths'
    parts). Hidden names (".git", macOS's "._scan.png") and other suffixes are passed over with a
    debug line; an image type espn does not read (".tiff") is refused by name. A link is taken only
    when it resolves to a regular file inside the root."""
    folder = root / relative if relative else root
    try:
        with os.scandir(folder) as scan:
            entries = sorted(scan, key=lambda entry: entry.name)
    except OSError as exc:
        yield relative, CorpusError(f"{folder}: cannot list ({exc.strerror or exc})")
        return
    for entry in entries:
        rel = f"{relative}/{entry.name}" if relative else entry.name
        shown = str(root / rel)
        if entry.name.startswith("."):
            log.debug("%s: hidden, passed over", shown)
        elif entry.is_dir(follow_symlinks=False):
            if depth + 1 >= MAX_DEPTH:
                yield rel, CorpusError(f"{shown}: refused, folders nested deeper than {MAX_DEPTH}")
            else:
                yield from _walk(root, rel, depth + 1)
        elif entry.is_symlink() and entry.is_dir():
            log.debug("%s: a link to a folder, not followed", shown)
        else:
            yield from _walked_file(root, rel, entry, shown)


def _walked_file(root: Path, rel: str, entry: os.DirEntry, shown: str) -> Iterator[tuple[str, Path | CorpusError]]:
    """_walk's answer for one file: passed over (not a page by its suffix), refused (an image type
    espn does not read, a link out of the root), or the real path to open."""
    found = _format(entry.name)
    if found is None:
        log.debug("%s: not an image or a PDF, passed over", shown)
    elif found.kind == "unsupported":
        yield rel, _unsupported(shown, found.label)
    elif entry.is_symlink():
        try:
            target = inside_root(root, rel, shown, error=CorpusError).resolve()
            regular_file(target, shown, error=CorpusError)
        except CorpusError as exc:
            yield rel, exc
        else:
            yield rel, target
    else:
        yield rel, Path(entry.path)


def _file_pages(root: Path, rel: str, real: Path, dpi: int, read_as: _Format) -> Iterator[Page | CorpusError]:
    """The pages of one image or PDF (read as `read_as` says), or a CorpusError in place of each page
    (or file) that is bad."""
    shown = str(root / rel)
    problem = id_problem(rel)
    if problem is not None:
        yield CorpusError(f"{shown}: the path as a page id {quote_id(rel)} {problem}")
        return
    if read_as.kind == "unsupported":
        yield _unsupported(shown, read_as.label)
        return
    if read_as.kind == "image":
        try:
            yield Page(rel, rel, 1, {}, _read_image(real, shown, read_as.suffix))
        except CorpusError as exc:
            yield exc
        return
    try:
        pdf = PdfFile(real, shown)
    except CorpusError as exc:
        yield exc
        return
    with contextlib.closing(pdf):
        for number in range(1, pdf.pages + 1):
            page_id = f"{rel}#{number}"
            problem = id_problem(page_id)
            try:
                if problem is not None:
                    raise CorpusError(f"{shown}#{number}: page id {quote_id(page_id)} {problem}")
                yield Page(page_id, rel, number, {}, pdf.render(number, dpi))
            except CorpusError as exc:
                yield exc


# --- JSONL manifests ----------------------------------------------------------------------------------------


def _jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of the non-blank lines, each at most MAX_LINE_BYTES."""
    regular_file(path, str(path), follow_links=True, error=CorpusError)  # not a FIFO or a device
    try:
        with open(path, "rb") as f:
            number = 0
            while line := f.readline(MAX_LINE_BYTES + 1):
                number += 1
                if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                    raise CorpusError(f"{path}:{number}: refused, a line over {MAX_LINE_BYTES} bytes")
                if line.strip():
                    yield number, line
    except OSError as exc:
        raise CorpusError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _parse_record(where: str, line: bytes) -> tuple[str, str, dict[str, Any]]:
    """(id, image reference, metadata) of one JSONL line, or CorpusError naming file:line."""
    check_json_depth(line, where, error=CorpusError)  # before the parser, which recurses
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorpusError(f"{where}: malformed JSON ({one_line(exc)})") from None
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: expected a JSON object, got {type(record).__name__}")
    page_id = record.get("_id", record.get("id"))
    if isinstance(page_id, int) and not isinstance(page_id, bool):
        page_id = str(page_id)
    problem = id_problem(page_id)
    if problem is not None:
        raise CorpusError(f"{where}: page id {quote_id(page_id)} {problem}")
    assert isinstance(page_id, str)  # id_problem refuses anything else
    image = record.get("image")
    if not isinstance(image, str) or not image:
        raise CorpusError(f"{where}: 'image' must be a path relative to the JSONL's folder")
    try:
        metadata = check_metadata(record.get("metadata"))
    except ValueError as exc:
        raise CorpusError(f"{where}: {exc}") from None
    return page_id, image, metadata


def _split_reference(reference: str) -> tuple[str, int | None]:
    """("doc.pdf", 2) for "doc.pdf#2"; (reference, None) for anything else ("scan#1.png" is a file)."""
    path, hash_, number = reference.rpartition("#")
    if hash_ and _kind(path) == "pdf" and number.isascii() and number.isdigit():
        return path, int(number)
    return reference, None


def _jsonl_pages(path: Path, dpi: int) -> Iterator[Page | CorpusError]:
    root = path.parent
    seen: set[str] = set()
    pdf: PdfFile | None = None  # the last PDF named, kept open while consecutive records name its pages
    pdf_real: Path | None = None
    try:
        for number, line in _jsonl_lines(path):
            where = f"{path}:{number}"
            try:
                page_id, reference, metadata = _parse_record(where, line)
                if page_id in seen:  # an error even with skip_bad, as for text corpora
                    raise _Duplicate(f"{where}: duplicate page id {quote_id(page_id)}")
                rel, page_number = _split_reference(reference)
                read_as = _format(rel)
                if read_as is None or read_as.kind == "unsupported":
                    label = "" if read_as is None else f" (a {read_as.label} image)"
                    raise CorpusError(f"{where}: 'image' {reference!r} is not a PNG, JPEG, WebP or PDF (by its "
                                      f"suffix){label}")
                kind = read_as.kind
                target = inside_root(root, rel, where, error=CorpusError)
                real, shown = target.resolve(), f"{where}: {root / rel}"
                source = Path(rel).as_posix()
                if kind == "image":
                    image = _read_image(real, shown, os.path.splitext(rel)[1].lower())
                    page_number = 1
                else:
                    if pdf is None or pdf_real != real:
                        if pdf is not None:
                            pdf.close()
                            pdf = None
                        pdf, pdf_real = PdfFile(real, shown), real
                    page_number = _pdf_page(pdf, page_number, where, reference)
                    image = pdf.render(page_number, dpi)
                seen.add(page_id)
                yield Page(page_id, source, page_number, metadata, image)
            except _Duplicate:
                raise
            except CorpusError as exc:
                yield exc
    finally:
        if pdf is not None:
            pdf.close()


class _Duplicate(CorpusError):
    """A page id seen before: never skipped, since either page could be the one meant."""


def _pdf_page(pdf: PdfFile, number: int | None, where: str, reference: str) -> int:
    if number is None:
        if pdf.pages != 1:
            raise CorpusError(f"{where}: 'image' {reference!r} is a PDF of {pdf.pages} pages; name one as "
                              f"'{reference}#N'")
        return 1
    if not 1 <= number <= pdf.pages:
        raise CorpusError(f"{where}: 'image' {reference!r}: no page {number} (the PDF has {pdf.pages})")
    return number


# --- the public functions -----------------------------------------------------------------------------------


def is_page_corpus(path: Path) -> bool:
    """True for a folder holding an image or a PDF (at any depth), a file that is an image or a PDF
    by its name or (unless named like a text corpus) by its first bytes, including image types that
    are then refused by name (TIFF, GIF, ...), or a .jsonl whose first record has an "image" field;
    False for anything else (a text corpus)."""
    path = Path(path)
    if path.is_dir():
        return any(True for _ in _walk(path))  # an image or PDF, or a refusal naming one
    if not path.is_file():
        return False
    if _lone_format(path) is not None:
        return True
    if path.suffix.lower() != ".jsonl":
        return False
    try:
        first = next(_jsonl_lines(path), None)
    except CorpusError:
        return False
    if first is None or json_depth(first[1]) > MAX_JSON_DEPTH:  # the text reader refuses it, in one line
        return False
    try:
        record = json.loads(first[1])
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(record, dict) and "image" in record


def iter_pages(path: Path, *, dpi: int = DEFAULT_DPI, skip_bad: bool = False) -> Iterator[Page]:
    """The pages of a page corpus (see the module's docstring), one at a time, in a stable order.

    dpi: resolution of PDF pages, in [MIN_DPI, MAX_DPI] (InvalidParameterError, raised here, not at
    the first page). A bad page or file raises CorpusError, or is logged and skipped with skip_bad;
    a duplicate id raises in both cases."""
    _check_dpi(dpi)
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"{path}: no such file or folder")
    if not is_page_corpus(path):
        raise CorpusError(f"{path}: not a page corpus (a folder of images or PDFs, a PDF, an image, or a JSONL "
                          f"of {{\"_id\", \"image\"}} records)")
    return _pages(path, dpi, skip_bad)


def _items(path: Path, dpi: int) -> Iterator[Page | CorpusError]:
    if path.is_dir():
        for rel, found in _walk(path):
            if isinstance(found, CorpusError):
                yield found
            else:
                read_as = _format(rel)
                assert read_as is not None  # _walk yields the files named as an image or a PDF only
                yield from _file_pages(path, rel, found, dpi, read_as)
    elif (read_as := _lone_format(path)) is not None:
        real = path.resolve()  # the file the operator named, links followed
        yield from _file_pages(path.parent, path.name, real, dpi, read_as)
    else:
        yield from _jsonl_pages(path, dpi)


def _pages(path: Path, dpi: int, skip_bad: bool) -> Iterator[Page]:
    skipped = 0
    for item in _items(path, dpi):
        if isinstance(item, Page):
            yield item
        elif not skip_bad:
            raise item
        else:
            skipped += 1
            log.warning("skipped %s", item)
    if skipped:
        log.warning("%s: skipped %d bad page(s) or file(s)", path, skipped)


def count_pages(path: Path) -> int | None:
    """How many pages `iter_pages(path)` yields at most, without decoding or rendering any (PDFs are
    opened for their page count): for a progress bar. A file that cannot be opened counts 0; a JSONL
    counts its non-blank lines; None when `path` is not a page corpus."""
    path = Path(path)
    if not is_page_corpus(path):
        return None
    if path.is_file():
        read_as = _lone_format(path)
        if read_as is None:
            try:
                return sum(1 for _ in _jsonl_lines(path))
            except CorpusError:
                return None
        return _count_file(read_as.kind, path.resolve())
    return sum(_count_file(_kind(rel) or "", found) for rel, found in _walk(path) if not isinstance(found, CorpusError))


def _count_file(kind: str, real: Path) -> int:
    if kind == "image":
        return 1
    if kind != "pdf":
        return 0
    try:
        with contextlib.closing(PdfFile(real, str(real))) as pdf:
            return pdf.pages
    except CorpusError:
        return 0


def no_pages_error(path: Path) -> CorpusError:
    """Why a page corpus gives no page (`count_pages` said 0): the refusal of its first file (an
    encrypted PDF, a text file named .pdf, a page tree of too many pages, an image type that is not
    read), or, for a folder with none, that it has no pages."""
    for item in _items(Path(path), DEFAULT_DPI):
        if isinstance(item, CorpusError):
            return CorpusError(f"{item}; the corpus has no readable pages")
        break  # a page after all: the corpus changed since it was counted
    return CorpusError(f"{path}: the corpus has no pages")
