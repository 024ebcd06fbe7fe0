"""The ownership rule
------------------
Memory handed to a read belongs to the kernel (or to the engine's worker threads) until
every read that targets it has completed, or been cancelled, **and been reaped**. Only
then may it return to a pool, be reused or be freed. Every path keeps it:

- `submit` either returns an `EngineRead` that owns the reads it started, or raises
  having started nothing that is still in flight (it drains what it started first).
- `EngineRead.wait` raises only once the read is drained, except when the kernel stops
  answering (a read stuck past `IoLimits.timeout_s`, a ring that refuses every call):
  then `drained` stays False and the buffer must be quarantined, not returned.
- `EngineRead.cancel` withdraws what the kernel has not taken yet; what it has taken is
  reaped by the next `wait` (or by the queue's next exchange).
- `ReadEngine.close` waits for (or cancels and reaps) every read of every thread before
  it releases a ring or a context; a closed engine refuses new reads (`StoreClosedError`).

It is enforced in one place, the ledger: every read claims the address range of its
buffer in `LEDGER` when it starts and settles the claim only once it is drained. The
pools (`espn.store.buffers.BufferPool`, `espn.store.kvikio.DeviceBufferPool`) ask the ledger
through one `ReturnGuard` whenever a buffer comes back: a buffer still claimed is never
reused. Under the strict policy (the test suite's) that is an `OwnershipError`; in
production it is logged and the buffer is quarantined until its claims settle. With the
canary on, a returned buffer is filled with `CANARY` and checked when it is handed out
again, so a late write by the kernel into memory that was given back is caught.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from .errors import OwnershipError

__all__ = ["CANARY", "LEDGER", "BufferLedger", "OwnershipPolicy", "ReturnGuard", "ownership_policy",
           "set_ownership_policy"]

logger = logging.getLogger(__name__)

#: The byte a pool writes over a buffer given back to it when the canary is on.
CANARY = 0xA5

class BufferLedger:
    """Address ranges that reads in flight may still write into (process-wide).

    A read claims its buffer when it starts and settles the claim once drained. A claim
    may carry `poll`, a cheap non-blocking "has it drained?" (worker threads' futures), so
    that a quarantined buffer comes back even when nobody waits for its read. The number
    of claims is the number of reads in flight (tens), so a linear scan is cheap.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: dict[int, tuple[int, int, Callable[[], bool] | None]] = {}
        self._next = 1

    def claim(self, address: int, nbytes: int, poll: Callable[[], bool] | None = None) -> int:
        """Claim [address, address + nbytes); a token for `settle`."""
        with self._lock:
            token = self._next
            self._next += 1
            self._claims[token] = (address, address + max(1, nbytes), poll)
        return token

    def settle(self, token: int) -> None:
        with self._lock:
            self._claims.pop(token, None)

    def claimed(self, address: int, nbytes: int) -> bool:
        """Does a read in flight target any byte of [address, address + nbytes)?"""
        end = address + max(1, nbytes)
        with self._lock:
            hits = [(token, poll) for token, (start, stop, poll) in self._claims.items()
                    if start < end and address < stop]
        for token, poll in hits:
            if poll is None or not poll():
                return True
            self.settle(token)
        return False

    def outstanding(self) -> int:
        """Claims not settled yet (reads in flight, or stuck ones)."""
        with self._lock:
            return len(self._claims)

    def forget_all(self) -> None:
        """After fork, in the child: the parent's reads write into the parent's pages."""
        self._claims = {}
        self._lock = threading.Lock()


LEDGER = BufferLedger()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=LEDGER.forget_all)


@dataclasses.dataclass(frozen=True)
class OwnershipPolicy:
    """strict: a buffer given back while claimed raises OwnershipError (tests); otherwise it
    is logged and quarantined (production). canary: pools fill given-back buffers with
    CANARY and check them when handing them out again (tests; costs a memset and a compare)."""

    strict: bool = False
    canary: bool = False


_policy = OwnershipPolicy()


def ownership_policy() -> OwnershipPolicy:
    return _policy


def set_ownership_policy(policy: OwnershipPolicy) -> OwnershipPolicy:
    """Set the process-wide policy; returns the previous one."""
    global _policy
    previous, _policy = _policy, policy
    return previous


class ReturnGuard:
    """What a pool runs whenever a buffer comes back: the ledger check, the quarantine and
    the canary. The one place where the ownership rule is enforced.

    fill(buffer) writes CANARY over a buffer, intact(buffer) checks it; address(buffer)
    gives (address, nbytes) of its memory.
    """

    def __init__(self, what: str, address: Callable[[Any], tuple[int, int]], fill: Callable[[Any], None],
                 intact: Callable[[Any], bool]) -> None:
        self.what = what
        self._address = address
        self._fill = fill
        self._intact = intact
        self._lock = threading.Lock()
        self._quarantine: list[Any] = []
        self._poisoned: set[int] = set()  # id() of buffers carrying the canary

    def give_back(self, buffer: Any, known_in_flight: bool = False) -> bool:
        """True when `buffer` may be kept for reuse now; False when it is quarantined.

        known_in_flight: the caller knows reads may still target it (a failure it could not
        drain); it is quarantined without an ownership error.
        """
        address, nbytes = self._address(buffer)
        if LEDGER.claimed(address, nbytes):
            with self._lock:
                self._quarantine.append(buffer)
            if known_in_flight:
                logger.warning("a %s is quarantined until the reads still targeting it drain", self.what)
                return False
            message = (f"a {self.what} was given back while a read in flight still targets it "
                       f"(address {address:#x}, {nbytes} bytes); quarantined until that read drains")
            if _policy.strict:
                raise OwnershipError(message)
            logger.error(message)
            return False
        if _policy.canary:
            self._fill(buffer)
            with self._lock:
                self._poisoned.add(id(buffer))
        return True

    def handing_out(self, buffer: Any) -> None:
        """Check the canary of a buffer about to be reused (OwnershipError if it changed)."""
        with self._lock:
            poisoned = id(buffer) in self._poisoned
            self._poisoned.discard(id(buffer))
        if poisoned and not self._intact(buffer):
            raise OwnershipError(f"a {self.what} changed after it was given back: "
                                 "a read wrote into memory it no longer owned")

    def check(self, buffers: list[Any]) -> None:
        """Check the canary of free `buffers` now (tests; OwnershipError if one changed)."""
        with self._lock:
            poisoned = [b for b in buffers if id(b) in self._poisoned]
        for buffer in poisoned:
            if not self._intact(buffer):
                raise OwnershipError(f"a {self.what} changed after it was given back: "
                                     "a read wrote into memory it no longer owned")

    def forget(self, buffer: Any) -> None:
        with self._lock:
            self._poisoned.discard(id(buffer))

    def reclaim(self) -> list[Any]:
        """Quarantined buffers whose reads have drained: out of quarantine, for the pool."""
        with self._lock:
            if not self._quarantine:
                return []
            free = [b for b in self._quarantine if not LEDGER.claimed(*self._address(b))]
            if free:
                self._quarantine = [b for b in self._quarantine if all(b is not f for f in free)]
        return free

    @property
    def quarantined(self) -> int:
        """Buffers in quarantine (read without the lock: a hint for the pools' fast path)."""
        return len(self._quarantine)
