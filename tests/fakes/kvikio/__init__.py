"""A fake `kvikio` (26.10 API) that STANDS IN FOR A GPU in tests on a CPU-only machine.

Same public names and signatures as the real package where the reader uses them
(`CuFile`, `IOFuture`, `CompatMode`, `defaults.set/get/is_compat_mode_preferred`; the
signatures are checked against `kvikio_26.10.0_signatures.json`, taken from the
kvikio-cu12 26.10.0 wheel). Reads are plain `os.pread` calls into host numpy buffers, or
into torch tensors, which play the part of device memory (the real kvikio recognises CUDA
memory by `__cuda_array_interface__`). It models what the reader depends on, from
libkvikio 26.10's `FileHandle::pread` and `posix_io.hpp`:

- a process-wide thread pool of `num_threads` workers (default 1) that runs the tasks;
- device reads below `gds_threshold` (default 16 KiB) run synchronously in the caller's
  thread and return a finished future; host reads always go to the pool;
- a read split into `task_size` tasks; its future's `get()` raises the first task error;
- a read that reaches past the end of the file raises "POSIX error on pread: EOF".

`_fake` (not part of kvikio) lets a test hold reads in flight, inject failures and look
at the trace of calls.
"""

from __future__ import annotations

from . import defaults
from ._system import FakeSystem, _fake
from .cufile import CuFile, IOFuture
from .defaults import CompatMode

__version__ = "26.10.00"

__all__ = ["CuFile", "IOFuture", "CompatMode", "defaults", "FakeSystem", "_fake", "__version__"]
