"""The page images of an opened index or live generation (espn.pages.images), by global doc number."""

from __future__ import annotations

import functools

from ..index import IndexDirectory
from .images import PageImages, StoredPageImages
from ..generation.segments import LIVE_DIR, LiveView

__all__ = ["open_index_images"]


def open_index_images(index: IndexDirectory, view: LiveView | None) -> StoredPageImages:
    """The images of an index (its base) or of one generation of a live index.

    Under a view each part's offsets are mapped once per process and shared by every
    generation over the same base (segments never change); without one, the base's offsets
    are mapped now. No descriptor is kept: a read opens the blob and closes it.
    """
    if view is None:
        return StoredPageImages([PageImages.open(index.path, index.num_documents)], [0])
    shared = view.shared
    base = shared.attached("page-images", lambda: PageImages.open(view.base.path, view.generation.base_documents),
                           lambda _: None)
    parts, firsts = [base], [0]
    for info in view.generation.segments:
        directory = view.root / LIVE_DIR / info.name
        parts.append(shared.attached(f"page-images:{info.name}:{info.first}",
                                     functools.partial(PageImages.open, directory, info.documents), lambda _: None))
        firsts.append(info.first)
    return StoredPageImages(parts, firsts)
