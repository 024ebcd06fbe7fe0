"""What a read engine raises.

Transient errors (`TRANSIENT_ERRNOS`: EAGAIN, EBUSY, ENOMEM, EINTR) from the syscalls and
from single reads are retried with bounded exponential backoff (`IoLimits`), after
reaping what has completed; a read that exhausts its budget fails with one `ReadError`
naming the file, the offset and the errno.
"""

from __future__ import annotations

import errno
import os
from typing import Any

from ...errors import EspnError

__all__ = ["TRANSIENT_ERRNOS", "EngineUnavailable", "OwnershipError", "ReadError", "StoreClosedError", "describe_fd"]

#: Errors the kernel documents as "try again" (io_uring_enter(2), io_submit(2), io_getevents(2)).
TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EBUSY, errno.ENOMEM, errno.EINTR})

class EngineUnavailable(RuntimeError):
    """This engine cannot run here (syscall refused by seccomp, sysctl, old kernel...)."""


class StoreClosedError(EspnError, ValueError):
    """A read was started on a reader or an engine that is closed (or closing)."""


class OwnershipError(RuntimeError):
    """A buffer went back to its pool while a read could still write into it, or the kernel
    wrote into a buffer after it was given back (strict policy only; see the module doc)."""


class ReadError(OSError):
    """One read failed for good: the file, the offset and the errno, and why it was final."""

    def __init__(self, err: int, path: str, offset: int, detail: str = "") -> None:
        super().__init__(err, os.strerror(err))
        self.filename = path
        self.offset = offset
        self.detail = detail

    def __str__(self) -> str:
        name = errno.errorcode.get(self.errno or 0, str(self.errno))
        tail = f" {self.detail}" if self.detail else ""
        return f"reading {self.filename} at offset {self.offset} failed: {name} ({self.strerror}){tail}"

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.errno, self.filename, self.offset, self.detail)


def describe_fd(fd: int) -> str:
    """The path behind a descriptor, for error messages (only read on the error path)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"
