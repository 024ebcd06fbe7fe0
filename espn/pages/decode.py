"""Page images from untrusted bytes: the kind of a file by its first bytes, the pixel bounds from its header, RGB pixels.

Shared by page corpora (espn.pages.corpus) and page uploads (espn.live.encoding). An image is
decoded only as the format its name (a corpus file) or its first bytes (an upload) says, and
only once its header says its size is within MAX_SIDE_PX and MAX_PIXELS, so a decompression
bomb costs a header read. Decoding makes as few full-size copies as it can: an RGB image is
returned as decoded, an orientation from EXIF is applied in place, and 16- and 32-bit grey is
scaled to 8 bits in strips of rows (espn.pages.memory counts what one page costs).
"""

from __future__ import annotations

import struct
from typing import IO

import numpy as np
from PIL import Image, ImageOps

from ..errors import CorpusError

__all__ = ["IMAGE_FORMATS", "UNSUPPORTED_IMAGE_SUFFIXES", "MAX_IMAGE_BYTES", "MAX_SIDE_PX", "MAX_PIXELS",
           "SIGNATURE_BYTES", "sniff_kind", "check_pixels", "open_image", "decode_image", "one_line"]

#: Image suffixes (lower case) and the one Pillow format each must hold: a file is decoded
#: only as what its name says, so a PDF renamed .png is refused, not sniffed and parsed.
IMAGE_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}
#: Suffixes of image types that are not read as pages (their decoders are large and rarely
#: needed): a file with one is refused by name, not passed over as if it were no image.
UNSUPPORTED_IMAGE_SUFFIXES = {".tif": "TIFF", ".tiff": "TIFF", ".gif": "GIF", ".bmp": "BMP", ".heic": "HEIF",
                              ".heif": "HEIF", ".avif": "AVIF", ".jp2": "JPEG 2000", ".jxl": "JPEG XL"}
#: An image is decoded whole, so its file is bounded well above a 600-dpi A4 scan (~25 MB as PNG).
MAX_IMAGE_BYTES = 64 << 20
#: Pixel bounds of an image or a rendered page, checked from the header (or the page size
#: times the dpi) before decoding: an RGB page of 40 MP is 120 MB decoded; an A4 page at
#: 600 dpi is 35 MP. The side bound is WebP's own limit and refuses the 20,000-px scan.
MAX_SIDE_PX = 16_384
MAX_PIXELS = 40_000_000
#: How many first bytes `sniff_kind` looks at.
SIGNATURE_BYTES = 16
#: First bytes of each kind: a page format espn reads (by the Pillow format, or "PDF"), or one it names to refuse.
_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"%PDF-", "PDF"), (b"II*\x00", "TIFF"),
               (b"MM\x00*", "TIFF"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
               (b"\xff\x0a", "JPEG XL"), (b"\x00\x00\x00\x0cJXL ", "JPEG XL"))
#: Rows of a 16- or 32-bit grey image scaled to 8 bits at a time (bounds the float temporaries).
_STRIP_ROWS = 256

# What Pillow's decoders raise on malformed input besides OSError (its fuzzers found each);
# DecompressionBombError is an Exception of its own.
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, IndexError, TypeError, KeyError, ArithmeticError,
                  struct.error)
_WHITE = (255, 255, 255)


def sniff_kind(head: bytes) -> str | None:
    """What a file's first bytes (SIGNATURE_BYTES of them) say it is: "PNG", "JPEG", "WEBP",
    "PDF", or the name of an image type espn does not read ("TIFF", "GIF", "BMP", "HEIF", ...);
    None for anything else (text)."""
    for signature, kind in _SIGNATURES:
        if head.startswith(signature):
            return kind
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[4:8] == b"ftyp" and head[8:12] in (b"heic", b"heix", b"mif1", b"msf1", b"avif", b"avis"):
        return "AVIF" if head[8:12].startswith(b"avi") else "HEIF"
    if head[:2] == b"BM" and len(head) >= 14 and head[6:10] == b"\x00\x00\x00\x00":  # the reserved words are 0
        return "BMP"
    return None


def check_pixels(where: str, width: int, height: int, hint: str = "") -> None:
    """CorpusError naming `where` unless `width` x `height` is within MAX_SIDE_PX and MAX_PIXELS."""
    if width < 1 or height < 1:
        raise CorpusError(f"{where}: has no pixels ({width}x{height})")
    if max(width, height) > MAX_SIDE_PX or width * height > MAX_PIXELS:
        raise CorpusError(f"{where}: refused, {width}x{height} px (at most {MAX_SIDE_PX} px a side and "
                          f"{MAX_PIXELS:,} px in all){hint}")


def open_image(fp: IO[bytes], where: str, suffix: str) -> Image.Image:
    """The image in `fp` with only its header read, which must hold the format its suffix names (a
    key of IMAGE_FORMATS) within the pixel bounds; CorpusError in one line naming `where`."""
    expected = IMAGE_FORMATS[suffix]
    try:
        # Reads the header only. Pillow's own bomb check (MAX_IMAGE_PIXELS, a process-wide setting left
        # as it is) raises above 179 MP; ours, lower, follows before any pixel is decoded.
        image = Image.open(fp, formats=[expected])
    except Image.UnidentifiedImageError:
        fp.seek(0)
        found = sniff_kind(fp.read(SIGNATURE_BYTES))
        said = f" (its first bytes are a {found} file's)" if found is not None and found != expected else ""
        raise CorpusError(f"{where}: not a {expected} image{said}") from None
    except Image.DecompressionBombError as exc:  # raised by Image.open from the header alone
        raise CorpusError(f"{where}: refused, over Pillow's own bound ({one_line(exc)})") from None
    except _DECODE_ERRORS as exc:
        raise CorpusError(f"{where}: unreadable {expected} image ({one_line(exc)})") from None
    try:
        check_pixels(where, *image.size)
    except BaseException:
        image.close()
        raise
    return image


def decode_image(fp: IO[bytes], where: str, suffix: str) -> Image.Image:
    """The RGB image in `fp`, which must hold the format its suffix names (a key of IMAGE_FORMATS),
    within the pixel bounds checked from its header first; CorpusError in one line naming `where`.
    EXIF orientation is applied; alpha and palette transparency are flattened on white."""
    image = open_image(fp, where, suffix)
    rgb = None
    try:
        rgb = _to_rgb(image)
        return rgb
    except _DECODE_ERRORS as exc:
        raise CorpusError(f"{where}: unreadable {IMAGE_FORMATS[suffix]} image ({one_line(exc)})") from None
    finally:
        if rgb is not image:  # close() frees the pixels: only those of an image not handed back
            image.close()


def _to_rgb(image: Image.Image) -> Image.Image:
    """`image` decoded, EXIF orientation applied, as RGB: alpha and palette transparency flattened on
    white, 16- and 32-bit grey scaled to 8 bits (Pillow's own convert clips them), CMYK converted.
    An RGB image comes back as itself, loaded: no copy of its pixels."""
    image.load()
    ImageOps.exif_transpose(image, in_place=True)  # a transposed copy replaces the pixels only when told to
    if image.mode.startswith("I;16") or image.mode in ("I", "F"):
        return Image.fromarray(_grey_to_8_bits(image), "L").convert("RGB")
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, _WHITE)
        flat.paste(rgba, mask=rgba)  # an RGBA mask is its alpha band
        return flat
    return image if image.mode == "RGB" else image.convert("RGB")


def _grey_to_8_bits(image: Image.Image) -> np.ndarray:
    """A 16- or 32-bit grey image as uint8 [h, w], 0..65535 (or the float range 0..255 of "F")
    rounded to 0..255, a strip of rows at a time."""
    values = np.asarray(image)
    out = np.empty(values.shape, dtype=np.uint8)
    for start in range(0, values.shape[0], _STRIP_ROWS):
        strip = values[start : start + _STRIP_ROWS].astype(np.float64)
        if image.mode != "F":
            strip /= 257.0  # 0..65535 -> 0..255
        np.clip(np.rint(strip, out=strip), 0, 255, out=strip)
        out[start : start + _STRIP_ROWS] = strip
    return out


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, at most about 200 characters."""
    text = " ".join(str(exc).split())
    return (text[:200] + "...") if len(text) > 200 else text or type(exc).__name__
