"""Page images kept with a visual index: each page's rendered image, bounded and re-encoded.

Results, explanations and the search page show the page a hit is from them.

Three files per index directory (base) or delta segment, only in an index of pages:

    page_images.bin          the images one after another (JPEG, written by Pillow), no framing
    page_images_offsets.npy  int64 [documents + 1]: document i's image is
                             page_images.bin[offsets[i]:offsets[i + 1]] (empty: none stored)
    page_grids.npy           int32 [documents, 4]: document i's patch grid in its record
                             (espn.pages.grids.GRID_FIELDS; zeros: not known). Absent in an
                             index written before grids were kept: its pages have none.

As the passages' docs.jsonl: one append-only blob and a numpy offsets array, read by offset
on demand, no Python object per page in memory. Every writer of a page index writes them
beside its records (the build's assemble, a live write's delta segment), compaction carries
them (`concat_page_images`, `copy_page_images`), and the manifest and the generation records
list them with the index's other files, so snapshots and replicas copy them.

An image is stored at most `MAX_STORED_SIDE` px a side (the longest side scaled down, the
aspect kept), JPEG at `STORED_QUALITY`. The stored bytes are what `page_image`
returns; a thumbnail is made from them on request (a 256 px one of a 1,600 px page of text took
about 9 ms on the 2-core build machine: Pillow's draft mode decodes the JPEG at 1/4 or 1/8 scale).
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

from ..errors import InvalidParameterError
from ..index import GRIDS_FILE, IMAGE_OFFSETS_FILE, IMAGES_FILE, PAGE_IMAGE_FILES  # the files this module writes
from ..mapped import map_npy
from .decode import MAX_IMAGE_BYTES
from .grids import GRID_FIELDS, PageGrid, unknown_grids

__all__ = [
    "IMAGES_FILE",
    "IMAGE_OFFSETS_FILE",
    "GRIDS_FILE",
    "PAGE_IMAGE_FILES",
    "MAX_STORED_SIDE",
    "STORED_QUALITY",
    "MIN_THUMBNAIL_SIDE",
    "MAX_THUMBNAIL_SIDE",
    "encode_page_image",
    "media_type",
    "UPLOAD_SUFFIXES",
    "BASE64_PATTERN",
    "MAX_BASE64_CHARS",
    "decode_base64_image",
    "thumbnail",
    "PageImagesWriter",
    "write_page_images",
    "PageImages",
    "StoredPageImages",
    "present_image_files",
    "concat_page_images",
    "copy_page_images",
]

log = logging.getLogger(__name__)

#: Longest side of a stored page (px): legible text on an A4 page (about 190 dpi), bounded bytes.
MAX_STORED_SIDE = 1600
#: JPEG quality of a stored page: text stays sharp at 85, and the file is a third of quality 95's.
STORED_QUALITY = 85
#: Bounds of a thumbnail's longest side (px), as `thumbnail` and the HTTP API take them.
MIN_THUMBNAIL_SIDE, MAX_THUMBNAIL_SIDE = 16, MAX_STORED_SIDE
#: Documents per gather when compaction copies images.
_BLOCK = 1024
_MAGIC = ((b"\xff\xd8\xff", "image/jpeg"), (b"\x89PNG\r\n\x1a\n", "image/png"))
#: A page sent as text (the HTTP API's `image`): base64 (RFC 4648), padded; the pattern a schema
#: states and `decode_base64_image` checks, and the longest such text (espn.pages.decode.MAX_IMAGE_BYTES decoded).
BASE64_PATTERN = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
MAX_BASE64_CHARS = 4 * -(-MAX_IMAGE_BYTES // 3)
_BASE64 = re.compile(BASE64_PATTERN)
#: What a page upload may be (its media type, from its first bytes) -> the suffix espn.pages.decode decodes it as.
UPLOAD_SUFFIXES = {"image/png": ".png", "image/jpeg": ".jpg", "image/webp": ".webp"}


def encode_page_image(image: Image.Image, max_side: int = MAX_STORED_SIDE, quality: int = STORED_QUALITY) -> bytes:
    """The bytes stored for a page: RGB, its longest side scaled down to `max_side` px (never
    up), JPEG at `quality`."""
    image = image if image.mode == "RGB" else image.convert("RGB")
    if max(image.size) > max_side:
        scale = max_side / max(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        # reducing_gap: a cheap box reduction first, then Lanczos over the last factor of 2 or less
        image = image.resize(size, Image.Resampling.LANCZOS, reducing_gap=2.0)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=quality)  # optimize=True: 6% smaller, 4x slower to write
    return out.getvalue()


def media_type(data: bytes) -> str:
    """The media type of stored image bytes, from their first bytes ("application/octet-stream"
    for anything else: only this module writes the files)."""
    for magic, kind in _MAGIC:
        if data.startswith(magic):
            return kind
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "application/octet-stream"


def decode_base64_image(text: object) -> bytes:
    """The bytes of a page sent as base64 text; ValueError naming `image` for anything else (null,
    not a string, not padded base64, over MAX_BASE64_CHARS). What the bytes are is checked when
    the page is decoded (espn.live.encoding)."""
    if not isinstance(text, str) or len(text) < 4 or len(text) > MAX_BASE64_CHARS or not _BASE64.fullmatch(text):
        raise ValueError(f"image: a base64 text of 4 to {MAX_BASE64_CHARS} characters (RFC 4648: A-Z a-z 0-9 + /, "
                         "padded with = to a multiple of 4), not null")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image: not base64") from None


def thumbnail(data: bytes, max_side: int) -> bytes:
    """A stored image scaled down to at most `max_side` px a side, as JPEG (the bytes themselves
    when they are that small already). ValueError names `max_side` out of its bounds."""
    if isinstance(max_side, bool) or not isinstance(max_side, int) or \
            not MIN_THUMBNAIL_SIDE <= max_side <= MAX_THUMBNAIL_SIDE:
        raise InvalidParameterError(f"thumbnail side must be an integer in [{MIN_THUMBNAIL_SIDE}, "
                                    f"{MAX_THUMBNAIL_SIDE}], got {max_side!r}")
    with Image.open(io.BytesIO(data)) as image:  # bytes this index wrote, within MAX_STORED_SIDE
        if max(image.size) <= max_side:
            return data
        image.draft("RGB", (max_side, max_side))  # JPEG: decode at 1/2, 1/4 or 1/8 scale when it can
        small = image.convert("RGB")
        small.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    small.save(out, format="JPEG", quality=STORED_QUALITY)
    return out.getvalue()


class PageImagesWriter:
    """Streams the images (and patch grids) of documents written in order into `directory`'s
    files: the bytes go straight to page_images.bin, the lengths (one int64 a document) and
    grids (four int32) stay in memory until `finish()`; leaving without `finish()` (an error)
    removes what was written by `abort()`."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._blob = open(self.directory / IMAGES_FILE, "wb")
        self._lengths: list[np.ndarray] = []
        self._grids: list[np.ndarray] = []

    def append(self, images: Sequence[bytes | None], grids: np.ndarray | None = None) -> None:
        """Documents in turn, each its stored image bytes (None or b"": none) and grid row
        (`grids` [n, 4] int32, espn.pages.grids.GRID_FIELDS; None: not known)."""
        lengths = np.zeros(len(images), dtype=np.int64)
        for i, data in enumerate(images):
            if data:
                self._blob.write(data)
                lengths[i] = len(data)
        self._add(lengths, grids)

    def append_blob(self, blob: bytes | np.ndarray, lengths: np.ndarray, grids: np.ndarray | None = None) -> None:
        """Documents whose images lie back to back in `blob`, `lengths` [n] bytes each."""
        self._blob.write(blob.tobytes() if isinstance(blob, np.ndarray) else blob)
        self._add(np.asarray(lengths, dtype=np.int64), grids)

    def append_unknown(self, documents: int) -> None:
        self._add(np.zeros(int(documents), dtype=np.int64), None)

    def _add(self, lengths: np.ndarray, grids: np.ndarray | None) -> None:
        if grids is None:
            grids = unknown_grids(len(lengths))
        grids = np.asarray(grids)
        if grids.shape != (len(lengths), len(GRID_FIELDS)) or not np.issubdtype(grids.dtype, np.integer):
            raise ValueError(f"page grids of shape {grids.shape} ({grids.dtype}) for {len(lengths)} pages "
                             f"(one integer row of {len(GRID_FIELDS)} a page)")
        self._lengths.append(lengths)
        self._grids.append(grids.astype(np.int32, copy=False))

    def finish(self) -> None:
        """Write page_images_offsets.npy and page_grids.npy; every file fsynced."""
        self._blob.flush()
        os.fsync(self._blob.fileno())
        self._blob.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        grids = np.concatenate(self._grids) if self._grids else unknown_grids(0)
        for name, array in ((IMAGE_OFFSETS_FILE, offsets), (GRIDS_FILE, grids)):
            with open(self.directory / name, "wb") as f:
                np.save(f, array)
                f.flush()
                os.fsync(f.fileno())

    def abort(self) -> None:
        self._blob.close()
        for name in PAGE_IMAGE_FILES:
            (self.directory / name).unlink(missing_ok=True)


def write_page_images(directory: Path, images: Sequence[bytes | None], grids: np.ndarray | None = None) -> list[str]:
    """The files for `images` (one entry a document) and their `grids` in `directory`; the names written."""
    writer = PageImagesWriter(directory)
    try:
        writer.append(images, grids)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return list(PAGE_IMAGE_FILES)


def present_image_files(directory: Path) -> list[str]:
    """The image files `directory` holds (none, the images, or they and their grids): what a
    segment's file list adds."""
    return [name for name in PAGE_IMAGE_FILES if (Path(directory) / name).is_file()]


class PageImages:
    """One directory's images: the blob's path, offsets [n + 1] int64 and grids [n, 4] int32
    (memory-mapped; None: the directory keeps no grids). A read opens the blob, reads one range
    and closes it: no descriptor is kept."""

    def __init__(self, path: Path, offsets: np.ndarray, grids: np.ndarray | None = None) -> None:
        self.path, self.offsets, self.grids = Path(path), offsets, grids

    @classmethod
    def open(cls, directory: Path, documents: int) -> "PageImages | None":
        """The images of `directory` (holding `documents` documents); None when it has none, or,
        with a warning, when its two files do not fit together. Grids that do not fit the
        documents are left out, with a warning; the images stay."""
        directory = Path(directory)
        blob, offsets_path = directory / IMAGES_FILE, directory / IMAGE_OFFSETS_FILE
        if not blob.is_file() or not offsets_path.is_file():
            return None
        try:
            offsets = map_npy(offsets_path)
        except (ValueError, OSError) as exc:
            log.warning("%s: unreadable page image offsets (%s); its pages have no images", directory, exc)
            return None
        if offsets.dtype != np.int64 or offsets.shape != (documents + 1,) or int(offsets[0]) != 0 \
                or int(offsets[-1]) != blob.stat().st_size or bool(np.any(np.diff(offsets) < 0)):
            log.warning("%s: %s %s does not partition %s's %d bytes into %d images; its pages have no images",
                        directory, IMAGE_OFFSETS_FILE, offsets.shape, IMAGES_FILE, blob.stat().st_size, documents)
            return None
        return cls(blob, offsets, _open_grids(directory, documents))

    def of(self, local: int) -> bytes:
        """Document `local`'s image bytes (b"": none stored)."""
        start, stop = int(self.offsets[local]), int(self.offsets[local + 1])
        if stop == start:
            return b""
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(stop - start)


def _open_grids(directory: Path, documents: int) -> np.ndarray | None:
    path = directory / GRIDS_FILE
    if not path.is_file():
        return None  # written before grids were kept
    try:
        grids = map_npy(path)
    except (ValueError, OSError) as exc:
        log.warning("%s: unreadable page grids (%s); its pages have no grid", directory, exc)
        return None
    if grids.dtype != np.int32 or grids.shape != (documents, len(GRID_FIELDS)):
        log.warning("%s: %s is %s %s, not int32 [%d, %d]; its pages have no grid", directory, GRIDS_FILE,
                    grids.dtype, grids.shape, documents, len(GRID_FIELDS))
        return None
    return grids


class StoredPageImages:
    """Images by global doc number over a base and its delta segments (None parts: no files)."""

    def __init__(self, parts: Sequence[PageImages | None], firsts: Sequence[int]) -> None:
        self.parts, self.firsts = list(parts), np.asarray(firsts, dtype=np.int64)

    @property
    def any(self) -> bool:
        return any(part is not None for part in self.parts)

    def _locate(self, number: int) -> tuple[PageImages, int] | None:
        at = int(np.searchsorted(self.firsts, number, side="right")) - 1
        part = self.parts[at] if at >= 0 else None
        if part is None:
            return None
        local = int(number) - int(self.firsts[at])
        return (part, local) if 0 <= local < len(part.offsets) - 1 else None

    def of(self, number: int) -> bytes:
        """Document `number`'s image bytes (b"": none stored)."""
        found = self._locate(number)
        return b"" if found is None else found[0].of(found[1])

    def grid(self, number: int) -> PageGrid | None:
        """Document `number`'s patch grid as it was encoded (None: not kept, or not one grid)."""
        found = self._locate(number)
        if found is None or found[0].grids is None:
            return None
        return PageGrid.from_row(found[0].grids[found[1]])


def _copy_ranges(part: PageImages, local: np.ndarray, writer: PageImagesWriter, dead: np.ndarray | None = None) -> None:
    """The images and grids of documents `local` (in that order) of one part, appended to
    `writer`; dead [len(local)] bool: documents given an empty range and no grid instead."""
    blob = np.memmap(part.path, dtype=np.uint8, mode="r") if part.path.stat().st_size else np.zeros(0, np.uint8)
    try:
        for start in range(0, len(local), _BLOCK):
            rows = local[start : start + _BLOCK]
            starts = np.asarray(part.offsets[rows], dtype=np.int64)
            lengths = np.asarray(part.offsets[rows + 1], dtype=np.int64) - starts
            grids = unknown_grids(len(rows)) if part.grids is None else np.array(part.grids[rows], dtype=np.int32)
            if dead is not None:
                lengths[dead[start : start + _BLOCK]] = 0
                grids[dead[start : start + _BLOCK]] = 0
            gather = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
            writer.append_blob(np.asarray(blob[gather]), lengths, grids)
    finally:
        del blob


def concat_page_images(sources: Sequence[Path], documents: Sequence[int], out: Path,
                       holes: np.ndarray | None = None) -> list[str]:
    """The images of consecutive segments (directories holding `documents` documents each) as
    one segment's, written to `out`; returns the names written (none when no source has any).
    holes [sum(documents)] bool: documents left without an image (deleted in a merge)."""
    parts = [PageImages.open(directory, n) for directory, n in zip(sources, documents)]
    if all(part is None for part in parts):
        return []
    writer = PageImagesWriter(out)
    try:
        at = 0
        for part, n in zip(parts, documents):
            if part is None:
                writer.append_unknown(n)
            else:
                _copy_ranges(part, np.arange(n, dtype=np.int64), writer,
                             None if holes is None else np.asarray(holes[at : at + n], dtype=bool))
            at += n
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return list(PAGE_IMAGE_FILES)


def copy_page_images(stored: StoredPageImages, keep: np.ndarray, out: Path) -> list[str]:
    """The images of doc numbers `keep` (sorted), renumbered 0..len(keep)-1, written to `out`
    (a rewritten base); returns the names written (none when no part has any)."""
    if not stored.any:
        return []
    keep = np.asarray(keep, dtype=np.int64)
    bounds = np.searchsorted(keep, np.append(stored.firsts, np.iinfo(np.int64).max))
    writer = PageImagesWriter(out)
    try:
        for at, part in enumerate(stored.parts):
            local = keep[bounds[at] : bounds[at + 1]] - stored.firsts[at]
            if part is None:
                writer.append_unknown(len(local))
            else:
                _copy_ranges(part, local, writer)
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    return list(PAGE_IMAGE_FILES)
