"""The build job end to end: fit the encoder once, encode this shard, assemble when complete.

`build_index` is what `espn index` runs. With `num_shards > 1` each process encodes
its share of the chunks and the last step is `merge_index` (`espn index-merge`).
With `partitions > 1` the chunks are split into that many complete indexes
(`OUT/part-0` ...) that share one encoder and projection, so their scores compare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from espn.encoders import Encoder, encoder_from_spec, load_encoder
from espn.encoders.colbert_checkpoint import checkpoint_format
from espn.encoders.precomputed import PrecomputedEncoder
from espn.encoders.st_format import is_visual_save
from espn.choices import DEFAULT_BOW_DTYPE
from espn.choices import default_pool_factor as pool_factor_of_kind
from espn.corpus import PASSAGE_JOINER, check_title_joiner, default_title_joiner
from espn.errors import CorpusError, CorruptModelError, EspnError, IndexExistsError, InvalidParameterError
from espn.params import FIRST_STAGE_KINDS
from espn.files.durable import write_json_atomic
from espn.index import read_manifest
from espn.pages.corpus import DEFAULT_DPI, MAX_DPI, MIN_DPI, count_pages, is_page_corpus, no_pages_error
from espn.store.format import STORAGE_TYPES
from espn.store.recode import require_centroid_stage
from espn.first_stage.build import first_stage_kind
from espn.text.config import TextConfig

from .assemble import assemble, publish
from .encode import encode_corpus, read_sample
from .pages import encode_page_corpus
from .precomputed import import_embeddings
from .scan import scan_corpus
from .workdir import WorkDir

__all__ = ["default_pool_factor", "BuildConfig", "BuildError", "build_index", "merge_index", "build_from_embeddings", "keeping_partial", "check_modality"]

log = logging.getLogger(__name__)

def default_pool_factor(encoder: str) -> int:
    """The pool factor `espn index --encoder SPEC` uses unless told (espn.choices.default_pool_factor
    of the kind the spec loads as: a checkpoint given as hf:DIR loads as colbert: or visual:)."""
    kind, _, location = encoder.partition(":")
    if kind == "hf" and location and (checkpoint_format(location.partition("?")[0]) is not None
                                      or is_visual_save(location.partition("?")[0])):
        return 1  # encoder_from_spec loads it as colbert: (or visual:)
    return pool_factor_of_kind("hf" if kind in ("", "minilm") else kind)  # minilm: the generic encoder's default model


class BuildError(EspnError):
    """A build failed after it started writing `OUT.partial/`; the message says what to do with it."""


@contextlib.contextmanager
def keeping_partial(out: Path) -> Iterator[None]:
    """Turn a failure into one line that also says where the partial build is and how to go on."""
    work = WorkDir(out)
    existed = work.path.exists()
    try:
        yield
    except (EspnError, OSError, RuntimeError) as exc:
        if not work.path.exists() or isinstance(exc, (IndexExistsError, InvalidParameterError)):
            raise
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            reason = f"no space left on device{' writing ' + str(exc.filename) if exc.filename else ''}"
        elif isinstance(exc, OSError):
            reason = f"{exc.strerror or exc}{': ' + str(exc.filename) if exc.filename else ''}"
        else:
            reason = str(exc)
        kept = "kept" if existed else "left"
        raise BuildError(f"{reason} (the partial build is {kept} in {work.path}: fix the cause and re-run the same "
                         f"command to resume, or delete it)") from exc


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    corpus: Path
    out: Path
    encoder: str = "minilm"
    bow_dim: int = 64
    nlist: int | None = None
    ann: str = "flat"
    pq_m: int = 32
    block_size: int = 4096
    pool_factor: int | None = None  # None: default_pool_factor(encoder)
    bow_dtype: str = DEFAULT_BOW_DTYPE
    bow_pooling: str = "tokens"  # "words": whole words, stop words out (Hugging Face encoders)
    chunk_size: int = 1024
    batch_size: int = 32
    fit_sample: int = 256  # documents; ~60k token vectors, plenty for a 384x384 second moment
    skip_bad: bool = False
    force: bool = False
    shard: int = 0
    num_shards: int = 1
    partitions: int = 1
    score_weight: float | None = None  # None: the model's learned w, else 0.3 until calibrated
    loader_workers: int = 1
    device: str | None = None
    progress: bool = True
    text_index: TextConfig | None = dataclasses.field(default_factory=TextConfig)  # None: no full-text index
    first_stage: str | None = None  # None: centroids for encoders without a trained CLS vector, else ivf
    trust_remote_code: bool = False  # let an hf:/colbert: model that needs its own code run it (recorded in the manifest)
    encoder_precision: str = "fp32"  # or int8 (espn.encoders.int8): checked against its budget, recorded in the manifest
    title_joiner: str | None = None  # between a BEIR title and its text; None: default_title_joiner(encoder kind)
    dpi: int = DEFAULT_DPI  # a page corpus: the resolution PDF pages are rendered at

    @property
    def pages(self) -> bool:
        """Whether the corpus is pages (a folder of images or PDFs, a PDF, a JSONL of images)."""
        return is_page_corpus(Path(self.corpus))

    def validate(self) -> "BuildConfig":
        if not Path(self.corpus).is_file() and not (Path(self.corpus).is_dir() and self.pages):
            raise CorpusError(f"{self.corpus}: no such file" if not Path(self.corpus).exists() else
                              f"{self.corpus}: a folder without images or PDFs (a text corpus is one file)")
        if not 0 <= self.shard < self.num_shards:
            raise InvalidParameterError(f"--shard must be I/N with 0 <= I < N, got {self.shard}/{self.num_shards}")
        for name, low in (("chunk_size", 1), ("batch_size", 1), ("fit_sample", 1), ("partitions", 1), ("pq_m", 1)):
            if getattr(self, name) < low:
                raise InvalidParameterError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.nlist is not None and self.nlist < 1:
            raise InvalidParameterError(f"--nlist must be >= 1, got {self.nlist}")
        if self.score_weight is not None and not 0.0 <= self.score_weight <= 1.0:
            raise InvalidParameterError(f"--score-weight must be in [0, 1], got {self.score_weight}")
        if self.pool_factor is not None and self.pool_factor < 1:
            raise InvalidParameterError(f"--pool-factor must be >= 1, got {self.pool_factor}")
        if self.bow_dtype not in STORAGE_TYPES:
            raise InvalidParameterError(f"--bow-dtype must be one of {', '.join(STORAGE_TYPES)}, got {self.bow_dtype!r}")
        if self.first_stage is not None:
            require_centroid_stage(self.bow_dtype, self.first_stage)
        if self.ann not in ("flat", "pq"):
            raise InvalidParameterError(f"--ann must be 'flat' or 'pq', got {self.ann!r}")
        if self.first_stage is not None and self.first_stage not in FIRST_STAGE_KINDS:
            raise InvalidParameterError(f"--first-stage must be one of {', '.join(FIRST_STAGE_KINDS)}, "
                                        f"got {self.first_stage!r}")
        if not MIN_DPI <= self.dpi <= MAX_DPI:
            raise InvalidParameterError(f"--dpi must be in [{MIN_DPI}, {MAX_DPI}], got {self.dpi}")
        if self.title_joiner is not None:
            check_title_joiner(self.title_joiner)
        if self.loader_workers not in (0, 1):
            raise InvalidParameterError("--loader-workers must be 0 or 1 (one tokenising process keeps up with the model)")
        return self

    def job(self) -> dict[str, Any]:
        """What makes two runs the same build (so the second resumes the first)."""
        stat = Path(self.corpus).stat()
        return {
            "corpus": str(Path(self.corpus).absolute()),
            "corpus_bytes": stat.st_size,
            "corpus_mtime_ns": stat.st_mtime_ns,
            "encoder": self.encoder,
            "bow_dim": self.bow_dim,
            "chunk_size": self.chunk_size,
            "fit_sample": self.fit_sample,
            "skip_bad": self.skip_bad,
            "num_shards": self.num_shards,
            "nlist": self.nlist,
            "ann": self.ann,
            "pq_m": self.pq_m,
            "block_size": self.block_size,
            "pool_factor": default_pool_factor(self.encoder) if self.pool_factor is None else self.pool_factor,
            "bow_dtype": self.bow_dtype,
            "bow_pooling": self.bow_pooling,
            "w": self.score_weight,
            "text_index": None if self.text_index is None else self.text_index.validate().to_json(),
            "first_stage": self.first_stage,
            # only when given, so that a partial build from before the flag existed still resumes
            **({"trust_remote_code": True} if self.trust_remote_code else {}),
            **({"encoder_precision": self.encoder_precision} if self.encoder_precision != "fp32" else {}),
            **({"title_joiner": self.title_joiner} if self.title_joiner is not None else {}),
            **({"pages": True, "dpi": self.dpi} if self.pages else {}),
        }


def _check_out(out: Path, partitions: int, force: bool) -> None:
    targets = [out] if partitions == 1 else [out / f"part-{p}" for p in range(partitions)]
    for target in targets:
        if target.exists() and not force:
            raise IndexExistsError(f"{target} exists; pass --force to replace it")


def _prepare_encoder(config: BuildConfig, work: WorkDir, documents: int | None = None) -> Encoder:
    """Fit (first process) or load (later processes, resumed runs) the one shared encoder.

    documents: the corpus' count when this process encodes next (lets a fit that saw the
    whole corpus hand its forward passes to the encode)."""
    with work.locked():
        resumed = work.claim(config.job())
        job = work.job()
        if "encoder_config" in job and work.encoder_dir.is_dir():
            if resumed:
                log.info("resuming the build in %s", work.path)
            return load_encoder(work.encoder_dir, job["encoder_config"], device=config.device,
                                trust_remote_code=config.trust_remote_code)
        staging = work.path / "encoder.tmp"
        try:
            encoder = encoder_from_spec(config.encoder, bow_dim=config.bow_dim, device=config.device,
                                        bow_pooling=config.bow_pooling, trust_remote_code=config.trust_remote_code,
                                        precision=config.encoder_precision)
            check_modality(encoder, config.pages, config.corpus)
            # before anything is encoded: this encoder's first stage is known now
            require_centroid_stage(config.bow_dtype, first_stage_kind(config.first_stage, encoder.config()))
            joiner = default_title_joiner(encoder.kind) if config.title_joiner is None else config.title_joiner
            if encoder.needs_fit:
                sample = read_sample(config.corpus, config.fit_sample, config.skip_bad, joiner)
                if not sample:
                    raise CorpusError(f"{config.corpus}: the corpus has no documents")
                # A corpus that is all sample and one chunk is encoded in the fit's own batches:
                # this process (shard 0 owns chunk 0) embeds it from the fit's forward passes.
                whole = documents is not None and len(sample) == documents <= config.chunk_size and config.shard == 0
                encoder.fit(sample, batch_size=config.batch_size, reuse=whole)
            shutil.rmtree(staging, ignore_errors=True)
            encoder.save(staging)
        except (InvalidParameterError, CorruptModelError):
            # A refused model or setting: no work of this build exists yet (nothing is encoded
            # before the encoder is saved), and re-running the command would be refused again.
            # A crash (anything else) keeps the directory so that the same command resumes.
            _discard_unstarted(work)
            raise
        os.replace(staging, work.encoder_dir)
        encoder_config = dict(encoder.config())
        encoder_config.setdefault("learned_weight", encoder.learned_weight)
        encoder_config.setdefault("bow_reduction", encoder.bow_reduction)
        # The joiner resolved for this encoder (a job without one, from before it was recorded, used ". ").
        write_json_atomic(work.job_file, {**job, "encoder_config": encoder_config, "passage_joiner": joiner})
        return encoder


def check_modality(encoder: Encoder, pages: bool, corpus: Path) -> None:
    """A page corpus needs an encoder of images, a text corpus one of text: one line otherwise."""
    visual = encoder.reads_pages
    if pages and not visual:
        raise InvalidParameterError(f"{corpus} is a page corpus (images or PDFs) but the {encoder.kind} encoder reads "
                                    "text: give a ColPali-class checkpoint (--encoder colbert:DIR or visual:DIR)")
    if visual and not pages:
        raise InvalidParameterError(f"{corpus}: a visual index takes pages: give a folder of images or PDFs, a PDF, "
                                    "or a JSONL of {\"_id\", \"image\"} records, not a text corpus")


def _discard_unstarted(work: WorkDir) -> None:
    """Remove `OUT.partial/` when it holds no encoded work (only its job file, lock and encoder staging)."""
    unstarted = {"job.json", "lock", "encoder.tmp"}
    if work.path.is_dir() and all(child.name in unstarted for child in work.path.iterdir()):
        work.remove()


def build_index(config: BuildConfig) -> dict[str, Any] | None:
    """Run the build; returns the manifest, or None when other shards must still finish."""
    config.validate()
    out = Path(config.out).absolute()
    _check_out(out, config.partitions, config.force)
    if config.pages:
        return _build_pages(config, out)
    # Every line parsed and ids checked before the model loads: seconds, not an encode.
    scan = scan_corpus(config.corpus, config.skip_bad)
    if scan.documents == 0:
        raise CorpusError(f"{config.corpus}: the corpus has no documents")
    work = WorkDir(out)
    encoder = _prepare_encoder(config, work, scan.documents)
    totals = encode_corpus(
        config.corpus, work.path, encoder, chunk_size=config.chunk_size, batch_size=config.batch_size,
        shard=config.shard, num_shards=config.num_shards, skip_bad=config.skip_bad,
        loader_workers=config.loader_workers, progress=config.progress, total_documents=scan.documents,
        joiner=work.job().get("passage_joiner", PASSAGE_JOINER),
    )
    return _shard_done(config, work, out, totals)


def _build_pages(config: BuildConfig, out: Path) -> dict[str, Any] | None:
    """build_index for a page corpus: pages rendered and encoded by the visual encoder into the same
    chunk files, then the same merge (ids are unique by construction or checked by the reader)."""
    pages = count_pages(Path(config.corpus))
    if pages == 0:  # the refusal of its first file, not only that nothing was found
        raise no_pages_error(Path(config.corpus))
    work = WorkDir(out)
    encoder = _prepare_encoder(config, work, pages)
    check_modality(encoder, True, config.corpus)  # a resumed build's saved encoder, too
    totals = encode_page_corpus(config.corpus, work.path, encoder, dpi=config.dpi,  # type: ignore[arg-type]
                                chunk_size=config.chunk_size, batch_size=config.batch_size, shard=config.shard,
                                num_shards=config.num_shards, skip_bad=config.skip_bad,
                                loader_workers=config.loader_workers, progress=config.progress, total_pages=pages)
    if totals["documents"] == 0:
        raise CorpusError(f"{config.corpus}: the corpus has no readable pages")
    return _shard_done(config, work, out, totals)


def _shard_done(config: BuildConfig, work: WorkDir, out: Path, totals: dict[str, Any]) -> dict[str, Any] | None:
    """Mark this shard encoded; merge now when it is the only one (the index's manifest), else None."""
    write_json_atomic(work.marker(config.shard, config.num_shards),
                      {"shard": config.shard, "num_shards": config.num_shards, **totals})
    if config.num_shards > 1:
        log.info("shard %d/%d encoded; run `espn index-merge --out %s` once every shard is done",
                 config.shard, config.num_shards, out)
        return None
    return merge_index(out, partitions=config.partitions, force=config.force)


def merge_index(out: Path, partitions: int = 1, force: bool = False) -> dict[str, Any]:
    """Assemble the encoded chunks into the index (or `partitions` indexes) and publish atomically."""
    out = Path(out).absolute()
    if partitions < 1:
        raise InvalidParameterError(f"--partitions must be >= 1, got {partitions}")
    _check_out(out, partitions, force)
    work = WorkDir(out)
    manifest: dict[str, Any] = {}
    if partitions == 1:
        manifest = assemble(work, work.path / "staging")
        publish(work.path / "staging", out, force)
    else:
        out.mkdir(parents=True, exist_ok=True)
        for p in range(partitions):
            staging = work.path / f"staging-{p}"
            manifest = assemble(work, staging, partition=p, partitions=partitions)
            publish(staging, out / f"part-{p}", force)
    work.remove()
    return manifest if partitions == 1 else read_manifest(out / "part-0")


def build_from_embeddings(source: Path, out: Path, *, block_size: int = 4096, nlist: int | None = None,
                          ann: str = "flat", pq_m: int = 32, chunk_size: int = 1024, corpus: Path | None = None,
                          force: bool = False, score_weight: float | None = None,
                          pool_factor: int = 1, bow_dtype: str = "float16",
                          text_index: TextConfig | None = TextConfig(),
                          first_stage: str | None = None) -> dict[str, Any]:
    """An index from precomputed embedding shards (any multi-vector model), no encoder run.

    first_stage: "ivf", "centroids" or "union" (espn.first_stage.centroids); None: the IVF alone (the
    shards' CLS vectors are taken to be trained ones unless told)."""
    out = Path(out).absolute()
    _check_out(out, 1, force)
    work = WorkDir(out)
    work.remove()  # importing is cheap; always start clean
    with work.locked():
        totals = import_embeddings(Path(source), work.path, chunk_size, corpus=corpus)
        if score_weight is not None:
            totals = {**totals, "score_weight": score_weight}
        encoder = PrecomputedEncoder.from_import(totals)
        encoder.save(work.encoder_dir)
        encoder_config = {**encoder.config(), "learned_weight": encoder.learned_weight,
                          "bow_reduction": encoder.bow_reduction}
        write_json_atomic(work.job_file, {
            "corpus": str(Path(source).absolute()), "block_size": block_size, "nlist": nlist, "ann": ann,
            "pq_m": pq_m, "encoder_config": encoder_config, "pool_factor": pool_factor, "bow_dtype": bow_dtype,
            # passages come only with a corpus: without one there is no text to index
            "text_index": None if corpus is None or text_index is None else text_index.validate().to_json(),
            "first_stage": first_stage,
        })
        chunks = -(-totals["documents"] // chunk_size)
        write_json_atomic(work.marker(0, 1), {"shard": 0, "num_shards": 1, "documents": totals["documents"],
                                              "chunks": chunks})
    return merge_index(out, force=force)
