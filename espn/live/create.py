"""An index created empty, in a fraction of a second, and removing one safely.

`create_index` writes a valid index of no documents for an encoder: its encoder files, a
base with no records, an IVF of one list and the "exact" first stage (espn.live.fitting),
a full-text index with no passages. Nothing in it is fitted on text that is not its own:
it answers searches (no hits) and takes writes at once; its IVF, token centroids and
residual codes are fitted on its own documents once it holds EXACT_MAX_DOCUMENTS of them,
and again each time it has grown by half (the base rewrites of espn.live.compaction).

An encoder that fits a projection of its token vectors (the generic Hugging Face encoder's
PCA, `espn index --bow-dim`) is saved without one: the index stores the model's own token
vectors while it is exact, and its first fitted base fits the projection on them and projects
them (espn.store.projection; `NewIndex.bow_dim`, fitted once, docs/guides/live-index.md).

The encoder's files are written once per model in a directory of templates and hard-linked
into each index created with it (its files are immutable and checksummed), so a creation
copies no model. Crash safety: everything is built inside `ROOT/.creating-NAME-XXXX/` and
moved to `ROOT/NAME` by one rename once complete and synced; `remove_leftovers(ROOT)` removes
what a killed creation (or deletion) left. A deletion renames `ROOT/NAME` to
`ROOT/.deleted-NAME-XXXX` first (one atomic step: from then on the index is gone), then
removes that directory. Names starting with "." are never index names, so neither kind of
leftover is ever served.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from ..choices import DEFAULT_BOW_DTYPE, default_pool_factor
from ..corpus import default_title_joiner
from ..encoders import Encoder
from ..encoders.base import reads_pages
from ..encoders.hf import DEFAULT_BOW_DIM
from ..errors import IndexExistsError, InvalidParameterError
from ..files.checksums import file_entry
from ..files.durable import fsync_path, fsync_tree
from ..first_stage.build import default_first_stage, first_stage_kind
from ..generation.format import read_current
from ..generation.segments import open_view
from ..index import FORMAT_VERSION, write_manifest
from ..pages.images import PageImagesWriter
from ..partitioning import PartitionLayout
from ..store.format import RECORD_DTYPE, RecordWriter, StoreLayout
from ..store.recode import written_before_centroids
from ..text.config import TextConfig
from ..text.directory import DEFAULT_HYBRID, build_for_directory
from .fitting import CLS_TABLE, Fit, fit_base
from .rewrite import link_tree

__all__ = ["CREATING_PREFIX", "DELETED_PREFIX", "STAGING_MARK", "TEMPLATES_DIR", "NewIndex", "EncoderFiles", "create_index",
           "remove_index", "remove_leftovers", "live_documents", "encoder_template"]

logger = logging.getLogger(__name__)

CREATING_PREFIX = ".creating-"
DELETED_PREFIX = ".deleted-"
#: The file that marks a directory of an index root as espn's own staging (a creation or a
#: deletion in progress): only such directories are ever removed as leftovers.
STAGING_MARK = ".espn-staging"
#: Where an index root keeps one saved copy of each model its indexes were created with.
TEMPLATES_DIR = ".espn-models"


@dataclasses.dataclass(frozen=True)
class NewIndex:
    """How an index is created: its storage type and block size, its first stage once fitted
    (None: the model's default), a full-text index (None: none), the title joiner (None: the
    model's), the dimension of the projection it fits on its own token vectors once fitted
    (None: DEFAULT_BOW_DIM where its encoder fits one, the generic Hugging Face encoder, else none;
    the model's width: none), and how its writes pool token vectors (None: as `espn index` pools
    them for this encoder, espn.choices.default_pool_factor)."""

    dtype: str = DEFAULT_BOW_DTYPE
    block_size: int = 4096
    first_stage: str | None = None
    text_index: TextConfig | None = TextConfig()
    title_joiner: str | None = None
    bow_dim: int | None = None
    pool_factor: int | None = None


@dataclasses.dataclass(frozen=True)
class EncoderFiles:
    """An encoder saved in `directory`/encoder/: its manifest entry, and its files' entries
    (`encoder/...` -> bytes and sha256) as a manifest lists them."""

    directory: Path
    kind: str
    config: dict[str, Any]
    files: dict[str, dict[str, Any]]

    @classmethod
    def save(cls, encoder: Encoder, directory: Path) -> "EncoderFiles":
        """Save `encoder` into `directory`/encoder/ and take its entries (hashing its files once)."""
        encoder.save(directory / "encoder")
        config = {**encoder.config(), "learned_weight": encoder.learned_weight, "bow_reduction": encoder.bow_reduction}
        files = {str(path.relative_to(directory)): file_entry(path)
                 for path in sorted((directory / "encoder").rglob("*")) if path.is_file()}
        return cls(directory, encoder.kind, config, files)


def encoder_template(root: Path, encoder: Encoder) -> EncoderFiles:
    """`encoder` saved once under ROOT/.espn-models/ (keyed by its configuration, which names its
    weights' checksum), for created indexes to link their encoder/ to instead of copying it."""
    config = {**encoder.config(), "learned_weight": encoder.learned_weight, "bow_reduction": encoder.bow_reduction}
    key = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]
    folder = Path(root) / TEMPLATES_DIR / f"{encoder.kind}-{key}"
    record = folder / "encoder-files.json"
    if not record.is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".template-", dir=folder.parent))
        try:
            saved = EncoderFiles.save(encoder, staging)
            (staging / "encoder-files.json").write_text(json.dumps({"config": saved.config, "files": saved.files}))
            fsync_tree(staging)
            os.rename(staging, folder)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):  # another process made it meanwhile
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    saved = json.loads(record.read_text())
    return EncoderFiles(folder, encoder.kind, saved["config"], saved["files"])


def create_index(target: Path | str, encoder: Encoder | EncoderFiles, options: NewIndex = NewIndex()) -> Path:
    """An empty index at `target` for `encoder`: an unfitted Encoder (as espn.encoders.encoder_from_spec
    makes it), saved into the index, or its saved files (encoder_template), linked. IndexExistsError
    when `target` exists (also when another process created it meanwhile: the final rename refuses
    to replace it)."""
    target = Path(target).absolute()
    if target.exists() or target.is_symlink():
        raise IndexExistsError(f"{target} exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{CREATING_PREFIX}{target.name}-", dir=target.parent))
    (work / STAGING_MARK).touch()
    try:
        out = work / "index"
        out.mkdir()
        if isinstance(encoder, EncoderFiles):
            link_tree(encoder.directory / "encoder", out / "encoder")
            saved = encoder
        else:
            saved = EncoderFiles.save(encoder, out)
        write_manifest(out, _empty_base(out, saved, options), known=saved.files)
        open_view(out, verify="fast").close()  # it opens as a server will open it
        fsync_tree(out)
        try:
            os.rename(out, target)  # atomic; refuses a non-empty target
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise IndexExistsError(f"{target} exists") from exc
            raise
        fsync_path(target.parent)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    logger.info("index created", extra={"path": str(target), "encoder": saved.kind})
    return target


def _empty_base(out: Path, encoder: EncoderFiles, options: NewIndex) -> dict[str, Any]:
    """The files of a base of no documents at `out`, fitted exact; returns its manifest."""
    config = encoder.config
    layout = StoreLayout(int(config["d_cls"]), int(config["d_bow"]), options.block_size, dtype=options.dtype)
    written = written_before_centroids(layout)
    with RecordWriter(out / "embeddings.bin", written) as records:
        records.close()
    np.save(out / "records.npy", np.zeros(0, dtype=RECORD_DTYPE))
    np.save(out / "ids.npy", np.zeros(0, dtype="S1"))
    np.save(out / "ids_sorted.npy", np.zeros(0, dtype=np.int64))
    (out / "docs.jsonl").write_bytes(b"")
    np.save(out / "docs_offsets.npy", np.zeros(1, dtype=np.int64))
    np.save(out / CLS_TABLE, np.zeros((0, layout.d_cls), dtype=np.float16))
    if reads_pages(config):
        PageImagesWriter(out).finish()
    stage = dataclasses.replace(default_first_stage(config), kind=first_stage_kind(options.first_stage, config))
    pool_factor = default_pool_factor(str(config["kind"])) if options.pool_factor is None else options.pool_factor
    if pool_factor < 1:
        raise InvalidParameterError(f"pool_factor must be >= 1, got {pool_factor}")
    fitted = fit_base(out, written, 0, Fit(exact=True, stage=stage, dtype=options.dtype,
                                          projection=_projection_dim(config, options.bow_dim)), pool_factor=pool_factor)
    weight = config.get("learned_weight")
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "created": fitted["fit"]["at"],
        "encoder": config,
        "counts": {"documents": 0, "bow_vectors": 0},
        **{section: fitted[section] for section in ("store", "ann", "fit", "search_defaults", "first_stage")},
        "score": {"w": weight if weight is not None else 0.3, "bow_reduction": config.get("bow_reduction", "mean"),
                  "calibrated": weight is not None},
        "partition": PartitionLayout().to_json(),
        "source": {"created": True},
        "passage": {"title_joiner": options.title_joiner if options.title_joiner is not None else
                    default_title_joiner(encoder.kind)},
    }
    if options.text_index is not None:
        manifest["text"] = build_for_directory(out, options.text_index.validate())
        manifest["hybrid"] = DEFAULT_HYBRID.to_json()
    return manifest


def _check_name(root: Path, name: str) -> Path:
    target = root / name
    if not name or name.startswith(".") or "/" in name or "\0" in name or target.parent != root:
        raise InvalidParameterError(f"index name {name!r} is not a plain directory name")
    return target


def remove_index(root: Path | str, name: str) -> None:
    """Remove the index `ROOT/NAME`: marked as espn's, renamed to a `.deleted-` name in ROOT (from
    then on it is gone for every process), then removed. A symbolic link is refused, never followed."""
    root = Path(root).resolve()
    target = _check_name(root, name)
    if target.is_symlink() or not target.is_dir():
        raise InvalidParameterError(f"{target} is not an index directory inside {root}")
    (target / STAGING_MARK).touch()
    fsync_path(target)
    tombstone = root / f"{DELETED_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
    os.rename(target, tombstone)
    fsync_path(root)
    shutil.rmtree(tombstone, ignore_errors=True)


def remove_leftovers(root: Path | str) -> list[str]:
    """Remove what killed creations and deletions left in ROOT (the directories espn marked as
    its staging, never another's of the same name); the names removed."""
    root = Path(root)
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for child in root.iterdir():
        if child.name.startswith((CREATING_PREFIX, DELETED_PREFIX)) and not child.is_symlink() and child.is_dir() \
                and (child / STAGING_MARK).is_file():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
    return sorted(removed)


def live_documents(root: Path | str) -> int:
    """Documents searchable in the index at ROOT now (deleted ones not counted); no lock needed."""
    return int(read_current(Path(root)).live_documents)


def _projection_dim(config: dict[str, Any], bow_dim: int | None) -> int | None:
    """The dimension of the projection a created index fits once fitted: `bow_dim`, or by default
    DEFAULT_BOW_DIM where its encoder fits one (its saved configuration names a "projection", none
    yet: the generic Hugging Face encoder); None where that is not narrower than its vectors."""
    width = int(config["d_bow"])
    if bow_dim is None:
        fits_one = "projection" in config and not config["projection"]
        bow_dim = DEFAULT_BOW_DIM if fits_one else width
    if not 1 <= bow_dim <= width:
        raise InvalidParameterError(f"bow_dim must be in [1, {width}] (the model's token vectors), got {bow_dim}")
    return bow_dim if bow_dim < width else None
