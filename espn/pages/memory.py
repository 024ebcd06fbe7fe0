"""Memory bounds of decoded pages: what one page costs, groups of pages that fit, and a process's page memory.

A page is bounded by its pixels (espn.pages.decode: MAX_PIXELS, from the header). Pages are
decoded, resized and encoded in groups (one model batch at most) whose cost stays within
MAX_GROUP_BYTES: the bound of one request, and of the build's loader. Every page write of a
process holds its group's cost from one `PageMemory` (a semaphore over bytes, not requests)
while its pixels exist, so requests and indexes together stay within the process's page memory.
A page that alone costs more than the whole of it can never be written (TooLargeError, HTTP
413); a group that must wait longer than `wait_s` for others to finish is refused for now
(PageMemoryBusyError, HTTP 503 with Retry-After).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterable, Iterator

from ..errors import PageMemoryBusyError, TooLargeError

__all__ = ["PAGE_BYTES_PER_PIXEL", "MAX_GROUP_BYTES", "DEFAULT_PAGE_MEMORY_BYTES", "PAGE_MEMORY_WAIT_S", "page_cost",
           "bounded_groups", "PageMemory", "process_page_memory", "configure_process_page_memory"]

log = logging.getLogger(__name__)

#: What one page costs at its peak, per pixel of the image: its RGB pixels (3 bytes, with the
#: allocator's slack about 4) while the model's processor makes its own copies of them to resize
#: (ColPali's SigLIP processor: 6 to 10 more), or, before that, decoding an RGBA image beside its
#: RGB copy (7.5). Measured at 39.7 MP: 13.4 (1-bit), 14.0 (RGB), 14.2 (RGBA) at most
#: (benchmarks/bench_page_memory.py, docs/guides/operating-limits.md); 16 leaves room.
PAGE_BYTES_PER_PIXEL = 16
#: The most a group of pages decoded together (one model batch at most) may cost: the bound of one
#: request's pixels, and of the page build's loader. A page of MAX_PIXELS (640 MB) is a group alone.
MAX_GROUP_BYTES = 512 << 20
#: Decoded pages one process holds at once, every request and index together (`espn serve
#: --page-memory-bytes`). One page of MAX_PIXELS fits, so every page the decoder takes can be
#: written with it.
DEFAULT_PAGE_MEMORY_BYTES = 1 << 30
#: How long a group waits for page memory that other writes hold before it is refused for now.
PAGE_MEMORY_WAIT_S = 30.0


def page_cost(width: int, height: int) -> int:
    """Bytes one page of `width` x `height` px costs at its peak (PAGE_BYTES_PER_PIXEL a pixel)."""
    return int(width) * int(height) * PAGE_BYTES_PER_PIXEL


def bounded_groups(costs: Iterable[int], max_pages: int, max_bytes: int) -> Iterator[range]:
    """Consecutive groups of the items of `costs` (their indexes as ranges, in order), each at most
    `max_pages` long and costing at most `max_bytes` together, or one item alone where it costs more."""
    start = count = total = 0
    for cost in costs:
        if count and (count == max_pages or total + cost > max_bytes):
            yield range(start, start + count)
            start, count, total = start + count, 0, 0
        count += 1
        total += cost
    if count:
        yield range(start, start + count)


class PageMemory:
    """A process's budget of decoded page bytes, shared by every thread that decodes pages.

    `hold(n)` blocks until `n` bytes are free (first come, first served), for at most `wait_s`.
    """

    def __init__(self, capacity_bytes: int = DEFAULT_PAGE_MEMORY_BYTES, wait_s: float = PAGE_MEMORY_WAIT_S) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        if not wait_s >= 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s!r}")
        self.capacity, self.wait_s = capacity_bytes, float(wait_s)
        self._held = 0
        self._queue: list[object] = []  # waiting holders in arrival order: no large group starves
        self._cond = threading.Condition()

    @property
    def held(self) -> int:
        """Bytes held right now."""
        with self._cond:
            return self._held

    @property
    def group_bytes(self) -> int:
        """The most one group may cost here: MAX_GROUP_BYTES, or the whole budget where it is smaller."""
        return min(MAX_GROUP_BYTES, self.capacity)

    def check_fits(self, cost: int, what: str) -> None:
        """TooLargeError naming `what` when `cost` bytes can never be held here."""
        if cost > self.capacity:
            raise TooLargeError(f"{what} would take {cost / 2**20:.0f} MiB decoded, over this process's page memory "
                                f"of {self.capacity / 2**20:.0f} MiB; send a smaller image")

    @contextlib.contextmanager
    def hold(self, nbytes: int, what: str = "pages") -> Iterator[None]:
        """Hold `nbytes` for the block: TooLargeError at once when they can never fit,
        PageMemoryBusyError when they are not free within `wait_s`."""
        self.check_fits(nbytes, what)
        ticket = object()
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            self._queue.append(ticket)
            try:
                while self._queue[0] is not ticket or self._held + nbytes > self.capacity:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PageMemoryBusyError(
                            f"{what}: {nbytes / 2**20:.0f} MiB of page memory not free within {self.wait_s:g} s "
                            f"({self._held / 2**20:.0f} of {self.capacity / 2**20:.0f} MiB held by other writes); retry")
                    self._cond.wait(left)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()
            self._held += nbytes
        try:
            yield
        finally:
            with self._cond:
                self._held -= nbytes
                self._cond.notify_all()


_process_memory: PageMemory | None = None
_process_lock = threading.Lock()


def process_page_memory() -> PageMemory:
    """This process's page memory (DEFAULT_PAGE_MEMORY_BYTES unless configured)."""
    global _process_memory
    with _process_lock:
        if _process_memory is None:
            _process_memory = PageMemory()
        return _process_memory


def configure_process_page_memory(capacity_bytes: int, wait_s: float = PAGE_MEMORY_WAIT_S) -> PageMemory:
    """Set this process's page memory (a server does at start-up, from its settings); what is held
    now stays held against the old budget, which every new hold no longer sees."""
    global _process_memory
    memory = PageMemory(capacity_bytes, wait_s)
    with _process_lock:
        _process_memory = memory
    log.info("page memory: %d MiB for the decoded pages of this process", capacity_bytes >> 20)
    return memory
