"""An empty live index, made for a server's `POST /v1/indexes`, and removing one safely.

An index needs trained structures before it takes a write: the encoder's fitted state (the
token projection), the IVF quantizer (`ann.faiss`) and, for some encoders, the token-centroid
first stage; and a base to hang its deltas on. None of them can be trained on a corpus that
does not exist yet, so `create_empty_index` builds an index of the bundled sample corpus
(espn/data/sample_corpus.jsonl, 300 short passages) with the requested encoder, by running
the build command (`espn index`) in a child process, and then deletes every one of its
documents. What is left is searchable and empty; the first write past the compaction policy
rewrites the base from the live documents only (deleted ones dropped), with the quantizer
and the encoder state trained on the sample kept, the token centroids retrained on the
documents kept. What that costs in quality is measured in docs/guides/serving.md.

Crash safety: everything is built inside `ROOT/.creating-NAME-XXXX/` and moved to `ROOT/NAME`
by one rename once complete and synced; `remove_leftovers(ROOT)` removes what a killed
creation (or deletion) left. A deletion renames `ROOT/NAME` to `ROOT/.deleted-NAME-XXXX`
first (one atomic step: from then on the index is gone), then removes that directory.
Names starting with "." are never index names, so neither kind of leftover is ever served.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path


from espn.errors import EspnError, IndexExistsError, InvalidParameterError
from espn.files import fsync_path, fsync_tree
from espn.generation.format import read_current
from espn.generation.segments import open_view
from espn.mapped import read_npy

from .live_index import LiveIndex

__all__ = ["SAMPLE_CORPUS", "CREATING_PREFIX", "DELETED_PREFIX", "CreateIndexError", "create_empty_index",
           "remove_index", "remove_leftovers", "live_documents"]

logger = logging.getLogger(__name__)

#: What the quantizers of a created index are trained on.
SAMPLE_CORPUS = Path(__file__).resolve().parents[1] / "data" / "sample_corpus.jsonl"
CREATING_PREFIX = ".creating-"
DELETED_PREFIX = ".deleted-"
#: How long the build of a created index may take (the sample corpus: ~20 s on 2 cores with MiniLM).
CREATE_TIMEOUT_S = 900.0


class CreateIndexError(EspnError):
    """The build of a new index failed (the encoder would not load, the disk is full, ...)."""


def _check_name(root: Path, name: str) -> Path:
    target = root / name
    if not name or name.startswith(".") or "/" in name or "\0" in name or target.parent != root:
        raise InvalidParameterError(f"index name {name!r} is not a plain directory name")
    return target


def create_empty_index(root: Path | str, name: str, encoder: str, *, corpus: Path = SAMPLE_CORPUS,
                       timeout_s: float = CREATE_TIMEOUT_S, nice: int = 10) -> Path:
    """Build `ROOT/NAME`: an index with `encoder` (a build's `--encoder` spec) and no documents,
    its quantizers trained on `corpus`. IndexExistsError when NAME exists (also when another
    process created it meanwhile: the final rename refuses to replace it)."""
    root = Path(root).resolve()
    target = _check_name(root, name)
    if target.exists() or target.is_symlink():
        raise IndexExistsError(f"{target} exists")
    work = Path(tempfile.mkdtemp(prefix=f"{CREATING_PREFIX}{name}-", dir=root))
    try:
        out = work / "index"
        _build(corpus, out, encoder, timeout_s, nice)
        _delete_every_document(out)
        open_view(out, verify="fast").close()  # it opens as a server will open it
        fsync_tree(out)
        try:
            os.rename(out, target)  # atomic; refuses a non-empty target
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise IndexExistsError(f"{target} exists") from exc
            raise
        fsync_path(root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    logger.info("index created", extra={"index": name, "encoder": encoder, "path": str(target)})
    return target


def _build(corpus: Path, out: Path, encoder: str, timeout_s: float, nice: int) -> None:
    """`espn index CORPUS --out OUT --encoder ENCODER` in a child process (the build job is not
    part of the library; its command is), at a lower CPU priority than the searches."""
    command = [sys.executable, "-m", "espn.cli", "index", str(corpus), "--out", str(out), "--encoder", encoder,
               "--no-progress"]
    env = {key: value for key, value in os.environ.items() if key != "PROMETHEUS_MULTIPROC_DIR"}

    def lower_priority() -> None:
        os.nice(nice)

    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env,
                              preexec_fn=lower_priority, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise CreateIndexError(f"building the index took more than {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        lines = [line for line in (done.stderr or done.stdout or "").splitlines() if line.strip()]
        raise CreateIndexError(f"building the index with encoder {encoder!r} failed: "
                               f"{lines[-1] if lines else f'exit status {done.returncode}'}")


def _delete_every_document(out: Path) -> None:
    ids = [bytes(item).decode() for item in read_npy(out / "ids.npy")]
    writer = LiveIndex(out)
    try:
        writer.delete(ids)
    finally:
        writer.close()


def remove_index(root: Path | str, name: str) -> None:
    """Remove the index `ROOT/NAME`: renamed to a `.deleted-` name in ROOT (from then on it is
    gone for every process), then removed. A symbolic link is refused, never followed."""
    root = Path(root).resolve()
    target = _check_name(root, name)
    if target.is_symlink() or not target.is_dir():
        raise InvalidParameterError(f"{target} is not an index directory inside {root}")
    tombstone = root / f"{DELETED_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
    os.rename(target, tombstone)
    fsync_path(root)
    shutil.rmtree(tombstone, ignore_errors=True)


def remove_leftovers(root: Path | str) -> list[str]:
    """Remove what killed creations and deletions left in ROOT; the names removed."""
    root = Path(root)
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for child in root.iterdir():
        if child.name.startswith((CREATING_PREFIX, DELETED_PREFIX)) and not child.is_symlink() and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
    return sorted(removed)


def live_documents(root: Path | str) -> int:
    """Documents searchable in the index at ROOT now (deleted ones not counted); no lock needed."""
    return int(read_current(Path(root)).live_documents)
