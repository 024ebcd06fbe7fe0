"""The default reader on a GPU machine: kvikio `CuFile` reads into GPU memory.

With GPUDirect Storage the SSD DMAs straight into device memory; where GDS is absent
kvikio falls back to its own parallel POSIX path with a bounce buffer, still landing
in GPU memory. The extents are planned like posix (`plan_extents`), all issued at once
as `pread` futures (kvikio's thread pool keeps them in flight), and the base class
parses the buffer on the GPU, so the records never touch host memory.

kvikio needs libcuda, so it is an optional extra (`pip install "espn[kvikio]"`),
imported only when this reader is opened or probed, never when the module is imported.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import BackendUnavailableError, InvalidParameterError
from .base import DEFAULT_MAX_EXTENT_BYTES, Reader, plan_extents
from .format import StoreLayout

__all__ = ["KvikioReader", "INSTALL_COMMAND"]

logger = logging.getLogger(__name__)

INSTALL_COMMAND = 'pip install "espn[kvikio]"'


@functools.lru_cache(maxsize=1)
def _unavailable_reason() -> str | None:
    """Probe once per process: importing kvikio loads libcuda, which is not free."""
    try:
        import kvikio  # noqa: F401
    except Exception as exc:  # ImportError, or OSError/RuntimeError when libcuda is missing
        return f"the kvikio reader needs kvikio ({type(exc).__name__}: {exc}); install it with: {INSTALL_COMMAND}"
    if not torch.cuda.is_available():
        return (
            "the kvikio reader needs a CUDA device and a CUDA build of torch, and torch sees none; "
            f"on a GPU machine install the extra with: {INSTALL_COMMAND}"
        )
    return None


class KvikioReader(Reader):
    """`kvikio.CuFile.pread` of coalesced extents into one buffer on `device`.

    With a CUDA `device` the buffer is a torch CUDA tensor (kvikio accepts anything with
    `__cuda_array_interface__`) and the parse runs on the GPU; with a CPU device kvikio
    reads into host memory with its thread pool. Options:
      max_extent_bytes: cap on one coalesced request (default 1 MiB, rounded to blocks)
      task_size:        kvikio's split of one request into tasks (default: kvikio's)
    bytes_read = sum of extent sizes, ios = extents.
    """

    name = "kvikio"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return _unavailable_reason()

    def __init__(
        self,
        path: Path,
        records: np.ndarray,
        layout: StoreLayout,
        device: str | torch.device = "cpu",
        *,
        max_extent_bytes: int = DEFAULT_MAX_EXTENT_BYTES,
        task_size: int | None = None,
        **options: Any,
    ) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(reason)
        super().__init__(path, records, layout, device, **options)
        if isinstance(max_extent_bytes, bool) or not isinstance(max_extent_bytes, int) or max_extent_bytes < 1:
            raise InvalidParameterError(f"max_extent_bytes must be a positive integer, got {max_extent_bytes!r}")
        if task_size is not None and (not isinstance(task_size, int) or task_size < 1):
            raise InvalidParameterError(f"task_size must be a positive integer or None, got {task_size!r}")
        import kvikio

        self.max_extent_bytes = max(layout.block_size, max_extent_bytes - max_extent_bytes % layout.block_size)
        self.task_size = task_size
        self._file = kvikio.CuFile(self.path, "r")

    def _fetch(self, offsets: np.ndarray, lengths: np.ndarray) -> tuple[Any, np.ndarray, int, int]:
        plan = plan_extents(offsets, lengths, self.layout.block_size, self.max_extent_bytes)
        buf: Any
        if self.device.type == "cuda":
            buf = torch.empty(plan.nbytes, dtype=torch.uint8, device=self.device)
            # kvikio writes outside torch's stream order: the caching allocator may hand
            # back a block that queued kernels on this stream still read. Wait for them.
            torch.cuda.current_stream(self.device).synchronize()
        else:
            buf = np.empty(plan.nbytes, dtype=np.uint8)
        futures = []
        for file_offset, length, at in zip(
            plan.file_offsets.tolist(), plan.lengths.tolist(), plan.buffer_offsets.tolist()
        ):
            futures.append((at, length, self._file.pread(buf[at : at + length], length, file_offset, self.task_size)))
        # Wait for every future before raising: none may write into buf after we return.
        error: BaseException | None = None
        for at, length, future in futures:
            try:
                got = future.get()
            except BaseException as exc:  # re-raised below, after the others finish
                error = error or exc
                continue
            if got < length:  # past the end of an unpadded file: not part of any record
                buf[at + got : at + length] = 0
        if error is not None:
            raise error
        return buf, plan.starts, plan.nbytes, len(plan)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._file.close()
