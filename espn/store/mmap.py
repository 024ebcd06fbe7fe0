"""Baseline reader: the file memory-mapped with `MADV_RANDOM`, read by page faults.

This is the mmap baseline of the paper: the kernel pages records in on demand through
the page cache. `MADV_RANDOM` turns readahead off, so a fault reads one page, not a
window around it. It is fast while the file fits in RAM and degrades when it does not.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .extents import plan_extents
from .format import StoreLayout
from .reader import Reader

__all__ = ["MmapReader"]

logger = logging.getLogger(__name__)


class MmapReader(Reader):
    """Gathers records straight out of a private, read-only-in-practice mapping.

    bytes_read and ios are an estimate, not a measurement: the number of distinct blocks
    the requested records touch (x block_size for bytes). The kernel faults at page
    granularity and the page cache may already hold some of them, so the real traffic
    can be lower (cached) or higher (block smaller than a page).
    """

    name = "mmap"
    follows_appends = False  # a map of the file as it was at open
    reads_into_buffers = False  # views of the map

    def __init__(
        self,
        path: Path,
        records: np.ndarray,
        layout: StoreLayout,
        device: str | torch.device = "cpu",
        **options: Any,
    ) -> None:
        super().__init__(path, records, layout, device, **options)
        self._mmap: mmap.mmap | None = None
        if self.file_size:
            with open(self.path, "rb") as file:
                # ACCESS_COPY (MAP_PRIVATE) gives a writable buffer, which torch.from_numpy
                # wants; nothing ever writes to it, so no page is ever copied.
                self._mmap = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
            if hasattr(self._mmap, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                self._mmap.madvise(mmap.MADV_RANDOM)
            self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        else:
            self._array = np.zeros(0, dtype=np.uint8)

    def _fetch(self, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
        # The union of the records' block ranges; the extent cap does not change its size.
        plan = plan_extents(offsets, lengths, self.layout.block_size)
        blocks = plan.nbytes // self.layout.block_size
        array = self._array  # before the check: see Reader.ensure_open
        self.ensure_open()
        return array, offsets, plan.nbytes, blocks

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._array = np.zeros(0, dtype=np.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A read in another thread still holds a view; the mapping goes when it ends.
                logger.debug("mmap of %s still exported at close; left to the garbage collector", self.path)
            self._mmap = None
