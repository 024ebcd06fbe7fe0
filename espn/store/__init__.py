"""The on-disk embedding store: record format, writer, and the readers behind one contract.

`READERS` maps the names the CLI and the server accept to reader classes; `open_reader`
picks one (kvikio where CUDA and kvikio work, posix elsewhere) and fails with the install
command when an optional backend is missing. Importing this package imports no optional
dependency: kvikio is probed only when asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import BackendUnavailableError, InvalidParameterError
from .engines import ENGINE_ORDER, ENGINES
from .extents import DEFAULT_MAX_EXTENT_BYTES, ExtentPlan, plan_extents
from .format import (RECORD_DTYPE, STORAGE_DTYPE, STORAGE_TYPES, RecordWriter, StoreLayout, dequantize_int8, place_records,
                     quantize_int8, record_nbytes, split_records)
from .kvikio import KvikioReader
from .memory import MemoryReader
from .mmap import MmapReader
from .pending import PendingRead
from .posix import PosixReader
from .cache_policy import DEFAULT_POLICY
from .record_cache import CachedReader, with_record_cache
from .reader import Reader
from .records import ReadBatch, RecordBatch

__all__ = [
    "RECORD_DTYPE",
    "STORAGE_DTYPE",
    "STORAGE_TYPES",
    "StoreLayout",
    "quantize_int8",
    "dequantize_int8",
    "RecordWriter",
    "record_nbytes",
    "place_records",
    "split_records",
    "ReadBatch",
    "RecordBatch",
    "PendingRead",
    "ENGINES",
    "ENGINE_ORDER",
    "Reader",
    "ExtentPlan",
    "plan_extents",
    "DEFAULT_MAX_EXTENT_BYTES",
    "PosixReader",
    "KvikioReader",
    "MmapReader",
    "MemoryReader",
    "CachedReader",
    "with_record_cache",
    "READERS",
    "default_reader_name",
    "open_reader",
]

#: Reader classes by the name users pass (`--reader`, manifest, Searcher option).
READERS: dict[str, type[Reader]] = {
    cls.name: cls for cls in (PosixReader, KvikioReader, MmapReader, MemoryReader)
}


def default_reader_name(device: str | torch.device | None = None) -> str:
    """"kvikio" when CUDA and kvikio are both usable, else "posix".

    With a CPU `device` the answer is "posix" even on a GPU machine: reading into GPU
    memory only to copy the result back would be a detour.
    """
    if device is not None and torch.device(device).type != "cuda":
        return PosixReader.name
    return KvikioReader.name if KvikioReader.is_available() else PosixReader.name


def open_reader(
    name: str | None,
    path: Path,
    records: np.ndarray,
    layout: StoreLayout,
    device: str | torch.device = "cpu",
    **options: Any,
) -> Reader:
    """Open the reader called `name` (None: `default_reader_name(device)`) on embeddings.bin.

    options go to the reader's class, except those of the record cache (`espn.store.record_cache`):
    `record_cache_mb` (> 0: the reader behind a `CachedReader` with that RAM budget),
    `record_cache_share` (a key the processes sharing one copy give), `record_cache_policy`
    and `record_cache_warm` (fill a new cache from the file).
    Raises ValueError for an unknown name (listing the known ones) and
    BackendUnavailableError, with the install command, for a backend that cannot run here.
    """
    if name is None:
        name = default_reader_name(device)
    try:
        cls = READERS[name]
    except KeyError:
        raise InvalidParameterError(f"unknown reader {name!r}; choose one of {', '.join(sorted(READERS))}") from None
    reason = cls.unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(reason)
    cache = {name: options.pop(f"record_cache_{name}") for name in ("mb", "share", "policy", "warm")
             if f"record_cache_{name}" in options}
    reader = cls(Path(path), records, layout, device, **options)
    try:
        return with_record_cache(reader, cache.get("mb"), share=cache.get("share"),
                                 policy=cache.get("policy", DEFAULT_POLICY), warm=bool(cache.get("warm", False)))
    except BaseException:
        reader.close()
        raise
