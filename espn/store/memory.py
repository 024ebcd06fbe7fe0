"""Baseline reader: the whole embedding file in RAM, read once at open.

The in-memory system of the paper, the latency floor the SSD readers are compared
against. It costs RAM the size of embeddings.bin per process, and no more while it
loads: the file is read in chunks straight into the final array (no second copy), and
each chunk's page-cache pages are dropped behind the read, so a process in a memory
cgroup (which charges page cache too) peaks at the table's size, not at twice it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import IndexCorruptError
from .format import StoreLayout
from .reader import Reader

__all__ = ["MemoryReader"]

logger = logging.getLogger(__name__)

#: Bytes read per call while loading: large enough to stream at the device's speed, small
#: enough that the page cache behind the read never holds more than this.
LOAD_CHUNK_BYTES = 64 << 20


class MemoryReader(Reader):
    """Gathers records out of a host copy of the file; bytes_read = ios = 0."""

    name = "memory"
    io_bound = False
    reads_into_buffers = False
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
        self._array = load_file(self.path, self.file_size)
        logger.info("loaded %s into RAM (%.1f MiB)", self.path, self.file_size / 2**20)

    def _fetch(self, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
        array = self._array  # before the check: see Reader.ensure_open
        self.ensure_open()
        return array, offsets, 0, 0

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._array = np.zeros(0, dtype=np.uint8)


def load_file(path: Path, size: int, chunk_bytes: int = LOAD_CHUNK_BYTES) -> np.ndarray:
    """[size] uint8: the first `size` bytes of `path`, read into one array allocated once.

    Each chunk is read with `os.preadv` into its slice of the array, then its page-cache
    pages are dropped (`POSIX_FADV_DONTNEED`): the array is the only copy that stays.
    Raises IndexCorruptError when the file is shorter than `size`.
    """
    array = np.empty(size, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        _advise(fd, 0, 0, getattr(os, "POSIX_FADV_SEQUENTIAL", None))
        view = array.data  # a writable memoryview; preadv fills it in place
        got = 0
        while got < size:
            n = os.preadv(fd, [view[got: min(size, got + chunk_bytes)]], got)
            if n <= 0:
                raise IndexCorruptError(f"{path} shrank while it was being loaded ({got} of {size} bytes)")
            _advise(fd, got, n, getattr(os, "POSIX_FADV_DONTNEED", None))
            got += n
        view.release()
    finally:
        os.close(fd)
    return array


def _advise(fd: int, offset: int, length: int, advice: int | None) -> None:
    """posix_fadvise where the platform has it (a hint: its failure changes nothing read)."""
    if advice is not None and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, advice)
        except OSError:  # e.g. a filesystem without fadvise: only the page cache stays fuller
            pass
