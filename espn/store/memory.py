"""Baseline reader: the whole embedding file in RAM, read once at open.

The in-memory system of the paper, the latency floor the SSD readers are compared
against. It costs RAM the size of embeddings.bin per process.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import IndexCorruptError
from .format import StoreLayout
from .reader import Reader

__all__ = ["MemoryReader"]

logger = logging.getLogger(__name__)


class MemoryReader(Reader):
    """Gathers records out of a host copy of the file; bytes_read = ios = 0."""

    name = "memory"
    io_bound = False
    follows_appends = False  # a copy of the file as it was at open

    def __init__(
        self,
        path: Path,
        records: np.ndarray,
        layout: StoreLayout,
        device: str | torch.device = "cpu",
        **options: Any,
    ) -> None:
        super().__init__(path, records, layout, device, **options)
        self._array = np.empty(self.file_size, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as file:
            view = self._array.data  # a writable memoryview over the array
            got = 0
            while got < self.file_size:
                n = file.readinto(view[got:])
                if not n:
                    raise IndexCorruptError(f"{self.path} shrank while it was being loaded")
                got += n
            view.release()
        logger.info("loaded %s into RAM (%.1f MiB)", self.path, self.file_size / 2**20)

    def _fetch(self, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
        return self._array, offsets, 0, 0

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._array = np.zeros(0, dtype=np.uint8)
