"""Page corpora for visual document search: page images from a folder, a PDF or a JSONL manifest.

    folder/                 every PNG, JPEG, WebP and PDF under it, walked in sorted order
    report.pdf              each page rendered at `dpi`
    pages.jsonl             {"_id": ..., "image": "scans/a.png" or "doc.pdf#2", "metadata": {...}}

Ids are stable: the path relative to the root for an image ("scans/a.png"), `path#N` for
page N (1-based) of a PDF, the record's `_id` for a JSONL. Everything read here comes from
outside and follows espn.untrusted: files are bounded in size before they are opened, only
regular files are read, links and JSONL paths never lead out of the root, and an image's
or a page's pixel size is checked from its header before any pixel is decoded (so a
decompression bomb costs a header read). A bad page (an unreadable or truncated image, a
file that is not what its extension says, an encrypted or broken PDF, a page over the
pixel bound) is a one-line CorpusError naming the file and page, or, with `skip_bad`, a
warning and a count, as `espn.corpus` does for text lines.

Nothing holds a corpus: `iter_pages` yields one page at a time, and a PDF is read through
PDFium from its file (not loaded whole) and rendered one page at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import struct
from pathlib import Path
from typing import IO, Any, Iterator

import numpy as np
import pypdfium2 as pdfium
from PIL import Image, ImageOps

from ..errors import CorpusError, InvalidParameterError
from ..ids import id_problem, quote_id
from ..metadata import check_metadata
from ..untrusted import MAX_JSON_DEPTH, check_json_depth, inside_root, json_depth, open_regular, regular_file

__all__ = ["Page", "is_page_corpus", "iter_pages", "count_pages", "decode_image", "IMAGE_FORMATS", "PDF_SUFFIX", "MIN_DPI",
           "MAX_DPI", "DEFAULT_DPI", "MAX_IMAGE_BYTES", "MAX_PDF_BYTES", "MAX_PDF_PAGES", "MAX_SIDE_PX", "MAX_PIXELS"]

log = logging.getLogger(__name__)

#: Image suffixes (lower case) and the one Pillow format each must hold: a file is decoded
#: only as what its name says, so a PDF renamed .png is refused, not sniffed and parsed.
IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}
PDF_SUFFIX = ".pdf"
#: Rendering resolution of PDF pages. 144 dpi puts an A4 page at 1191x1684 px, above the
#: 448-896 px that ColPali-class processors resize to; 36 is a thumbnail, 600 a print scan.
MIN_DPI, MAX_DPI, DEFAULT_DPI = 36, 600, 144
#: An image is decoded whole, so its file is bounded well above a 600-dpi A4 scan (~25 MB as PNG).
MAX_IMAGE_BYTES = 64 << 20
#: PDFium reads a PDF through seeks, not whole; the bound stops a runaway file (a scanned
#: 1,000-page book at 300 dpi is about 300 MB), not memory.
MAX_PDF_BYTES = 512 << 20
#: Pages of one PDF: a bound on the work one file can ask for (PDFium's page tree is a count).
MAX_PDF_PAGES = 10_000
#: Pixel bounds of an image or a rendered page, checked from the header (or the page size
#: times the dpi) before decoding: an RGB page of 40 MP is 120 MB decoded; an A4 page at
#: 600 dpi is 35 MP. The side bound is WebP's own limit and refuses the 20,000-px scan.
MAX_SIDE_PX = 16_384
MAX_PIXELS = 40_000_000
#: A JSONL record is an id, a path and metadata (itself at most 16 KiB as JSON).
MAX_LINE_BYTES = 1 << 20
#: Folders nested deeper than this are refused (each level is an open directory scan).
MAX_DEPTH = 64

# What Pillow's decoders raise on malformed input besides OSError (its fuzzers found each);
# DecompressionBombError is an Exception of its own.
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, IndexError, TypeError, KeyError, ArithmeticError,
                  struct.error)
_WHITE = (255, 255, 255)


@dataclasses.dataclass(frozen=True)
class Page:
    """One page of a page corpus."""

    id: str  # "scan.png", "reports/a.pdf#3" (1-based page), or the JSONL record's "_id"
    source: str  # the file's path relative to the corpus root, "/"-separated
    page_number: int  # 1-based; 1 for an image file
    metadata: dict[str, Any]  # the JSONL record's "metadata" (checked by check_metadata), else {}
    image: Image.Image  # mode "RGB", at most MAX_SIDE_PX a side and MAX_PIXELS in all


def _kind(name: str) -> str | None:
    """'image', 'pdf' or None, from the suffix (case-insensitive)."""
    suffix = os.path.splitext(name)[1].lower()
    return "image" if suffix in IMAGE_FORMATS else "pdf" if suffix == PDF_SUFFIX else None


def _check_dpi(dpi: int) -> int:
    if isinstance(dpi, bool) or not isinstance(dpi, int) or not MIN_DPI <= dpi <= MAX_DPI:
        raise InvalidParameterError(f"dpi must be an integer in [{MIN_DPI}, {MAX_DPI}], got {dpi!r}")
    return dpi


def _check_pixels(where: str, width: int, height: int, hint: str = "") -> None:
    if width < 1 or height < 1:
        raise CorpusError(f"{where}: has no pixels ({width}x{height})")
    if max(width, height) > MAX_SIDE_PX or width * height > MAX_PIXELS:
        raise CorpusError(f"{where}: refused, {width}x{height} px (at most {MAX_SIDE_PX} px a side and "
                          f"{MAX_PIXELS:,} px in all){hint}")


# --- images -------------------------------------------------------------------------------------------------


def _to_rgb(image: Image.Image) -> Image.Image:
    """`image` decoded, EXIF orientation applied, as RGB: alpha and palette transparency flattened on
    white, 16- and 32-bit grey scaled to 8 bits (Pillow's own convert clips them), CMYK converted."""
    image = ImageOps.exif_transpose(image) or image
    if image.mode.startswith("I;16") or image.mode in ("I", "F"):
        values = np.asarray(image, dtype=np.float64)
        if image.mode != "F":
            values = values / 257.0  # 0..65535 -> 0..255
        return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), "L").convert("RGB")
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, _WHITE)
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image.convert("RGB")  # a new, loaded image even when already RGB (convert copies)


def decode_image(fp: IO[bytes], where: str, suffix: str) -> Image.Image:
    """The RGB image in `fp`, which must hold the format its suffix names (a key of IMAGE_FORMATS),
    within the pixel bounds checked from its header first; CorpusError in one line naming `where`."""
    expected = IMAGE_FORMATS[suffix]
    try:
        # Reads the header only. Pillow's own bomb check (MAX_IMAGE_PIXELS, a process-wide setting left
        # as it is) raises above 179 MP; ours, lower, follows before any pixel is decoded.
        image = Image.open(fp, formats=[expected])
        with image:
            _check_pixels(where, *image.size)
            return _to_rgb(image)
    except Image.UnidentifiedImageError:
        raise CorpusError(f"{where}: not a {expected} image") from None
    except Image.DecompressionBombError as exc:  # raised by Image.open from the header alone
        raise CorpusError(f"{where}: refused, over Pillow's own bound ({_one_line(exc)})") from None
    except _DECODE_ERRORS as exc:
        raise CorpusError(f"{where}: unreadable {expected} image ({_one_line(exc)})") from None


def _read_image(real: Path, shown: str, suffix: str) -> Image.Image:
    fd, info = open_regular(real, shown, error=CorpusError)
    with os.fdopen(fd, "rb") as fp:
        if info.st_size > MAX_IMAGE_BYTES:
            raise CorpusError(f"{shown}: refused, {info.st_size} bytes (at most {MAX_IMAGE_BYTES} for an image)")
        return decode_image(fp, shown, suffix)


# --- PDFs ---------------------------------------------------------------------------------------------------


class _Pdf:
    """One open PDF: its file and PDFium document, closed together by `close`."""

    def __init__(self, real: Path, shown: str) -> None:
        fd, info = open_regular(real, shown, error=CorpusError)
        self.file, self.shown, self.document = os.fdopen(fd, "rb"), shown, None
        try:
            if info.st_size > MAX_PDF_BYTES:
                raise CorpusError(f"{shown}: refused, {info.st_size} bytes (at most {MAX_PDF_BYTES} for a PDF)")
            try:  # PDFium reads through the file object's seek and readinto: the file is never loaded whole
                self.document = pdfium.PdfDocument(self.file)
            except pdfium.PdfiumError as exc:
                if getattr(exc, "err_code", None) == pdfium.raw.FPDF_ERR_PASSWORD or "password" in str(exc).lower():
                    raise CorpusError(f"{shown}: refused, the PDF is encrypted (it needs a password)") from None
                raise CorpusError(f"{shown}: not a readable PDF ({_one_line(exc)})") from None
            self.pages = len(self.document)
            if self.pages < 1:
                raise CorpusError(f"{shown}: not a readable PDF (no pages)")
            if self.pages > MAX_PDF_PAGES:
                raise CorpusError(f"{shown}: refused, {self.pages} pages (at most {MAX_PDF_PAGES} a PDF)")
        except BaseException:
            self.close()
            raise

    def render(self, number: int, dpi: int) -> Image.Image:
        """Page `number` (1-based) as RGB at `dpi`; its pixel size is checked before it is rendered."""
        where = f"{self.shown}#{number}"
        assert self.document is not None  # set by __init__, or it raised
        try:
            page = self.document[number - 1]
        except pdfium.PdfiumError as exc:
            raise CorpusError(f"{where}: unreadable page ({_one_line(exc)})") from None
        try:
            scale = dpi / 72  # PDF units are 1/72 inch
            width, height = (math.ceil(v * scale) for v in page.get_size())  # what render allocates
            _check_pixels(where, width, height, f" at {dpi} dpi")
            bitmap = page.render(scale=scale, rev_byteorder=True, fill_color=(*_WHITE, 255))
            try:
                return bitmap.to_pil().convert("RGB")  # a copy: the bitmap's buffer is freed below
            finally:
                bitmap.close()
        except (pdfium.PdfiumError, ValueError) as exc:
            raise CorpusError(f"{where}: cannot render ({_one_line(exc)})") from None
        finally:
            page.close()

    def close(self) -> None:
        try:
            if self.document is not None:
                self.document.close()
        finally:
            self.file.close()


# --- walking a folder ---------------------------------------------------------------------------------------


def _walk(root: Path, relative: str = "", depth: int = 0) -> Iterator[tuple[str, Path | CorpusError]]:
    """(relative path, real path to open or the CorpusError that refuses it) of every image and PDF
    under `root`, in sorted order of names at each level (so the order of the sorted relative paths'
    parts). Hidden names (".git", macOS's "._scan.png") and other suffixes are passed over with a
    debug line. A link is taken only when it resolves to a regular file inside the root."""
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
        elif _kind(entry.name) is None:
            log.debug("%s: not an image or a PDF, passed over", shown)
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


def _file_pages(root: Path, rel: str, real: Path, dpi: int) -> Iterator[Page | CorpusError]:
    """The pages of one image or PDF, or a CorpusError in place of each page (or file) that is bad."""
    shown = str(root / rel)
    problem = id_problem(rel)
    if problem is not None:
        yield CorpusError(f"{shown}: the path as a page id {quote_id(rel)} {problem}")
        return
    if _kind(rel) == "image":
        try:
            yield Page(rel, rel, 1, {}, _read_image(real, shown, os.path.splitext(rel)[1].lower()))
        except CorpusError as exc:
            yield exc
        return
    try:
        pdf = _Pdf(real, shown)
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
        raise CorpusError(f"{where}: malformed JSON ({_one_line(exc)})") from None
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
    pdf: _Pdf | None = None  # the last PDF named, kept open while consecutive records name its pages
    pdf_real: Path | None = None
    try:
        for number, line in _jsonl_lines(path):
            where = f"{path}:{number}"
            try:
                page_id, reference, metadata = _parse_record(where, line)
                if page_id in seen:  # an error even with skip_bad, as for text corpora
                    raise _Duplicate(f"{where}: duplicate page id {quote_id(page_id)}")
                rel, page_number = _split_reference(reference)
                kind = _kind(rel)
                if kind is None:
                    raise CorpusError(f"{where}: 'image' {reference!r} is not a PNG, JPEG, WebP or PDF (by its suffix)")
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
                        pdf, pdf_real = _Pdf(real, shown), real
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


def _pdf_page(pdf: _Pdf, number: int | None, where: str, reference: str) -> int:
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
    """True for a folder holding an image or a PDF (at any depth), a .pdf file, an image file, or a
    .jsonl whose first record has an "image" field; False for anything else (a text corpus)."""
    path = Path(path)
    if path.is_dir():
        return any(True for _ in _walk(path))  # an image or PDF, or a refusal naming one
    if not path.is_file():
        return False
    if _kind(path.name) is not None:
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
                yield from _file_pages(path, rel, found, dpi)
    elif _kind(path.name) is not None:
        real = path.resolve()  # the file the operator named, links followed
        yield from _file_pages(path.parent, path.name, real, dpi)
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
    if path.is_file() and _kind(path.name) is None:
        try:
            return sum(1 for _ in _jsonl_lines(path))
        except CorpusError:
            return None
    if path.is_file():
        return _count_file(path.name, path.resolve())
    return sum(_count_file(rel, found) for rel, found in _walk(path) if not isinstance(found, CorpusError))


def _count_file(name: str, real: Path) -> int:
    if _kind(name) == "image":
        return 1
    try:
        with contextlib.closing(_Pdf(real, name)) as pdf:
            return pdf.pages
    except CorpusError:
        return 0


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return (text[:200] + "...") if len(text) > 200 else text or type(exc).__name__
