"""One loaded query encoder per model in a worker process, shared by the indexes that use it.

Two indexes use the same model when their manifests' encoder entries are equal and their
`encoder/` directories hold the same files, byte for byte (a digest of names and contents):
a copy of an index, or several indexes built with one `--encoder`. Each open index holds a
reference (`acquire`); the encoder is dropped when its last index closes (`release`), so an
idle-closed index gives its model's memory back unless another index still uses it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from pathlib import Path
from typing import Any, Mapping, Optional

from . import load_encoder
from .base import Encoder

__all__ = ["SharedEncoders", "encoder_key"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20


def encoder_key(directory: Path, manifest_encoder: Mapping[str, Any]) -> str:
    """What makes two indexes' encoders the same: the manifest entry and the model files (`encoder/`)."""
    digest = hashlib.sha256(json.dumps(manifest_encoder, sort_keys=True, default=str).encode())
    if directory.is_dir():
        for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink()):
            digest.update(str(path.relative_to(directory)).encode() + b"\0")
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
    return digest.hexdigest()


@dataclasses.dataclass
class _Entry:
    encoder: Encoder
    users: int


class SharedEncoders:
    """The encoders loaded in this process, by `encoder_key`, with how many open indexes hold each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def acquire(self, directory: Path, manifest_encoder: Mapping[str, Any], device: Optional[str],
                trust_remote_code: bool) -> tuple[str, Encoder]:
        """(key, encoder) for an index's `encoder/` directory and manifest entry: the loaded one
        when another open index has the same model, else loaded now (load_encoder's checks,
        trust_remote_code included). Pair with `release(key)` when the index closes."""
        key = encoder_key(directory, manifest_encoder)
        with self._lock:  # loads are rare (an index opening); one at a time keeps a model from loading twice
            entry = self._entries.get(key)
            if entry is None:
                encoder = load_encoder(directory, manifest_encoder, device=device,
                                       trust_remote_code=trust_remote_code)
                entry = self._entries[key] = _Entry(encoder, 0)
                logger.info("encoder loaded", extra={"directory": str(directory), "encoder": manifest_encoder.get("kind")})
            else:
                logger.info("encoder shared", extra={"directory": str(directory), "encoder": manifest_encoder.get("kind")})
            entry.users += 1
            return key, entry.encoder

    def release(self, key: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.users -= 1
            if entry.users <= 0:
                del self._entries[key]

    def loaded(self) -> int:
        """How many encoders this process holds."""
        with self._lock:
            return len(self._entries)
