"""Where a page's patch vectors lie in its record: the patch grid that explanations and the
search page's heatmap read.

A ColPali page is a fixed square grid (32 x 32 patches at 448 px); a ColQwen page has its own
grid, set by the page's size (dynamic resolution: `image_grid_thw` from the processor, the
vision tower's 2 x 2 merge applied). The visual encoder finds each page's grid as it encodes
it (`espn.encoders.visual.VisualEncoder.embed_pages`), and the index keeps it per page beside
the page images (`espn.pages.images`, `page_grids.npy`) in `GRID_FIELDS` form.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np

__all__ = ["PageGrid", "GRID_FIELDS", "unknown_grids", "concat_grids"]

#: The stored form of a page's grid: one int32 row of these, all zeros where it is not known
#: (a page written before grids were kept, or a model whose patches are not one grid).
GRID_FIELDS = ("first", "rows", "columns", "vectors")


@dataclasses.dataclass(frozen=True)
class PageGrid:
    """A page's stored vectors: `vectors` in all, of which vectors[first : first + rows * columns]
    are the image patches in row-major order (row r, column c at first + r * columns + c)."""

    first: int
    rows: int
    columns: int
    vectors: int

    def position(self, vector: int) -> tuple[int, int] | None:
        """(row, column) of stored vector `vector`, None for a prompt vector."""
        at = int(vector) - self.first
        return divmod(at, self.columns) if 0 <= at < self.rows * self.columns else None

    @classmethod
    def from_row(cls, row: np.ndarray) -> "PageGrid | None":
        """A stored row (`GRID_FIELDS`), None where it holds no grid or one its vectors cannot hold."""
        first, rows, columns, vectors = (int(x) for x in row)
        if rows <= 0 or columns <= 0 or first < 0 or first + rows * columns > vectors:
            return None
        return cls(first, rows, columns, vectors)


def unknown_grids(pages: int) -> np.ndarray:
    """`pages` rows that say "no grid known"."""
    return np.zeros((int(pages), len(GRID_FIELDS)), dtype=np.int32)


class _WithGrids(Protocol):
    grids: np.ndarray | None

    def __len__(self) -> int: ...


def concat_grids(parts: Sequence[_WithGrids]) -> np.ndarray:
    """The grids of encoded batches one after another, "no grid known" for a batch without any."""
    return np.concatenate([p.grids if p.grids is not None else unknown_grids(len(p)) for p in parts])
