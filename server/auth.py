"""API keys scoped to indexes and roles: who may read, write or administer which index.

Keys come from a file (`--api-keys FILE`, ESPN_API_KEYS_FILE) that holds no key itself, only
each key's SHA-256, so the file can be read by the server and by an operator without leaking
what it guards (keys are random strings of 32 bytes or more: a digest is as good as the key
only to someone who can invert SHA-256):

    {"keys": [
      {"name": "tenant-a", "sha256": "<hex>", "role": "write", "indexes": ["tenant-a", "tenant-a-*"]},
      {"name": "ops",      "sha256": "<hex>", "role": "admin", "indexes": ["*"]}]}

`espn serve --hash-api-key` prints the digest of a key read from stdin. Roles nest: `read`
searches and reads documents and snapshots; `write` also adds, replaces and deletes
documents; `admin` also creates, deletes and re-fits indexes and takes snapshots. `indexes`
are index names or shell-style patterns (`tenant-a-*`); `*` is every index, the default
one included (its name is `default` unless `--index NAME=PATH` names it). The single
`ESPN_API_KEY` stays a full-access key (admin of every index).

Each worker reads the file at start and again when its modification time changes (looked
at once a second at most), so keys are added and revoked without a restart; a file that no
longer parses keeps the keys last read and logs why. A presented key is compared with every
known digest in constant time (`hmac.compare_digest`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import hmac
import logging
import threading
import time
from pathlib import Path
from typing import Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from espn.engine import RULES

__all__ = ["ROLES", "Principal", "KeyFile", "Keyring", "key_digest", "FULL_ACCESS", "required", "check_keys_file"]

logger = logging.getLogger(__name__)

#: The roles, weakest first: each may do what the ones before it may.
ROLES = ("read", "write", "admin")
Role = Literal["read", "write", "admin"]
#: Keys files are small: anything larger is refused before it is parsed.
MAX_KEYS_FILE_BYTES = 1 << 20
_RELOAD_EVERY_S = 1.0


def key_digest(key: str) -> str:
    """The SHA-256 (hex) of a key, as the keys file holds it."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class KeyEntry(BaseModel):
    """One key of the keys file."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, description="who holds the key (logged, never the key)")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="the key's SHA-256, lower-case hex")
    role: Role
    indexes: list[str] = Field(min_length=1, max_length=10_000,
                               description="index names or shell-style patterns; * is every index")


class KeyFile(BaseModel):
    """The keys file: `{"keys": [...]}`."""

    model_config = ConfigDict(extra="forbid")

    keys: list[KeyEntry] = Field(max_length=100_000)


@dataclasses.dataclass(frozen=True)
class Principal:
    """Who a request comes from: a key's name, its role and the indexes it reaches."""

    name: str
    role: str
    indexes: tuple[str, ...]

    def may(self, role: str, index: Optional[str]) -> bool:
        """Whether this key has `role` (or a stronger one) on `index` (None: on no index in particular)."""
        if ROLES.index(self.role) < ROLES.index(role):
            return False
        return index is None or self.reaches(index)

    def reaches(self, index: str) -> bool:
        return any(fnmatch.fnmatchcase(index, pattern) for pattern in self.indexes)


#: The principal of the single ESPN_API_KEY, and of every request when no key is set.
FULL_ACCESS = Principal("full-access", "admin", ("*",))


class Keyring:
    """The keys a worker accepts: the single full-access key and those of the keys file."""

    def __init__(self, full_access_key: Optional[str], keys_file: Optional[Path]) -> None:
        self._full = key_digest(full_access_key).encode() if full_access_key is not None else None
        self._file = keys_file
        self._entries: tuple[tuple[bytes, Principal], ...] = ()
        self._mtime: Optional[float] = None
        self._checked = 0.0
        self._lock = threading.Lock()
        if keys_file is not None:
            self._entries = _read(keys_file)  # at start a bad file is an error, not a warning
            self._mtime = keys_file.stat().st_mtime

    @property
    def enabled(self) -> bool:
        return self._full is not None or self._file is not None

    def principal(self, token: str) -> Optional[Principal]:
        """The principal of a presented key; None: no such key."""
        self._maybe_reload()
        digest = key_digest(token).encode()
        found: Optional[Principal] = None
        if self._full is not None and hmac.compare_digest(digest, self._full):
            found = FULL_ACCESS
        for known, principal in self._entries:  # every digest compared: the time does not say which matched
            if hmac.compare_digest(digest, known) and found is None:
                found = principal
        return found

    def _maybe_reload(self) -> None:
        if self._file is None or time.monotonic() - self._checked < _RELOAD_EVERY_S:
            return
        with self._lock:
            self._checked = time.monotonic()
            try:
                mtime = self._file.stat().st_mtime
            except OSError as exc:
                logger.warning("API keys file %s: %s; keeping the keys read last", self._file, exc)
                return
            if mtime == self._mtime:
                return
            try:
                self._entries = _read(self._file)
            except ValueError as exc:
                logger.warning("API keys file %s no longer reads (%s); keeping the keys read last", self._file, exc)
                return
            finally:
                self._mtime = mtime
            logger.info("API keys file reloaded", extra={"keys": len(self._entries)})


def _read(path: Path) -> tuple[tuple[bytes, Principal], ...]:
    """The keys file's entries (ValueError naming the problem: not a regular file, too large, too
    deeply nested, not JSON, wrong shape)."""
    try:
        # A link is followed: a Kubernetes Secret mounts its files as links into its own directory.
        parsed = KeyFile.model_validate(RULES.read_json_file(path, "API keys file", max_bytes=MAX_KEYS_FILE_BYTES,
                                                             follow_links=True, error=ValueError))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{path}: {where}: {first['msg']}") from None
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    return tuple((entry.sha256.encode(), Principal(entry.name, entry.role, tuple(entry.indexes)))
                 for entry in parsed.keys)


def check_keys_file(path: Path) -> Sequence[Principal]:
    """The keys file's principals, for the settings to refuse a bad file at start-up (ValueError)."""
    return [principal for _, principal in _read(path)]


def required(path: str, method: str, default_index: Optional[str]) -> tuple[Optional[str], str]:
    """(index, role) a /v1 request needs: the index it acts on (None: no one index, such as a
    listing or a creation, whose routes check the key's indexes themselves) and the least role."""
    parts = path.strip("/").split("/")[1:]  # after "v1"
    if parts and parts[0] == "indexes":
        if len(parts) == 1:
            return None, "admin" if method == "POST" else "read"
        index, rest = parts[1], parts[2:]
        if not rest:
            return index, "admin" if method == "DELETE" else "read"
        if rest[0] == "refit":
            return index, "admin"
        return index, _route_role(rest[0], method)
    return default_index or "default", _route_role(parts[0] if parts else "", method)


def _route_role(route: str, method: str) -> str:
    """The role a per-index route needs: searches and reads read, document writes write, taking
    a snapshot (disk) administers."""
    if route == "documents" and method in ("PUT", "DELETE", "POST"):
        return "write"
    if route == "snapshots" and method == "POST":
        return "admin"
    return "read"
