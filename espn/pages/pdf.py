"""One PDF of a page corpus, read through PDFium from its file (never loaded whole) and rendered a page at a time.

Everything in it is untrusted: the file is bounded in size before PDFium sees it, its page count
is bounded (a page tree claiming a million pages is refused at open), an encrypted PDF is named as
such, and a page's pixel size at the requested dpi is checked before it is rendered.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pypdfium2 as pdfium
from PIL import Image

from ..errors import CorpusError
from ..untrusted import open_regular
from .decode import check_pixels, one_line

__all__ = ["PDF_SUFFIX", "MAX_PDF_BYTES", "MAX_PDF_PAGES", "PdfFile"]

PDF_SUFFIX = ".pdf"
#: PDFium reads a PDF through seeks, not whole; the bound stops a runaway file (a scanned
#: 1,000-page book at 300 dpi is about 300 MB), not memory.
MAX_PDF_BYTES = 512 << 20
#: Pages of one PDF: a bound on the work one file can ask for (PDFium's page tree is a count).
MAX_PDF_PAGES = 10_000
_WHITE = (255, 255, 255)


class PdfFile:
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
                raise CorpusError(f"{shown}: not a readable PDF ({one_line(exc)})") from None
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
            raise CorpusError(f"{where}: unreadable page ({one_line(exc)})") from None
        try:
            scale = dpi / 72  # PDF units are 1/72 inch
            width, height = (math.ceil(v * scale) for v in page.get_size())  # what render allocates
            check_pixels(where, width, height, f" at {dpi} dpi")
            bitmap = page.render(scale=scale, rev_byteorder=True, fill_color=(*_WHITE, 255))
            try:
                return bitmap.to_pil().convert("RGB")  # a copy: the bitmap's buffer is freed below
            finally:
                bitmap.close()
        except (pdfium.PdfiumError, ValueError) as exc:
            raise CorpusError(f"{where}: cannot render ({one_line(exc)})") from None
        finally:
            page.close()

    def close(self) -> None:
        try:
            if self.document is not None:
                self.document.close()
        finally:
            self.file.close()
