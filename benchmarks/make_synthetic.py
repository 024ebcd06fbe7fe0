"""Generate a large synthetic ESPN index whose geometry comes from a real encoder.

    python -m benchmarks.make_synthetic --out /tmp/espn-synth-2m              # 2 M docs (default)
    python -m benchmarks.make_synthetic --out /tmp/espn-synth --docs 20000    # small
    python -m benchmarks.make_synthetic --out /tmp/msmarco-scale --docs 8841823   # MS MARCO v1 scale
    python -m benchmarks.make_synthetic --out /tmp/espn-synth-pages --pages 50000  # page images (issue 47)
    python -m benchmarks.make_synthetic --out /tmp/espn-synth-tokens --tokens --docs 2000000 \
        --source .espn/pf/index   # ColBERT-class token vectors (issue 46)

Geometry: the "centres" are the real MiniLM outputs of the SciFact corpus, read from a
built SciFact index (`--source`, default .espn/scifact-index): its CLS vectors projected by
PCA to `--d-cls` (128, as ColBERTer's) and its BOW vectors projected by PCA to
`--d-bow` (32). Each synthetic document mixes two real documents' CLS vectors plus
Gaussian jitter (so the IVF clusters have the uneven, topical structure of real data,
not the flat structure of uniform noise), and draws its BOW vectors from the first
one's real BOW vectors, jittered. Queries (`OUT.queries.npz`, the format of
`espn search --query-embeddings`) are drawn the same way around random centres, with
8–24 BOW vectors, like short questions.

BOW counts per passage follow a clipped log-normal with mean ~30 vectors (MS MARCO v1:
16.8 GB of 32-d fp16 BOW vectors over 8.8 M passages = 29.8 vectors per passage),
range 8..120, so a record of 128 + n*32 fp16 values is 0.8–7.9 KB, mostly one 4 KB
block. 2 M documents give an embedding file of about 5 GB; `--docs 8841823` reaches
MS MARCO v1 scale (about 19 GB of records, 16.8 GB of BOW).

The index is written through the real build path: chunk files (`indexing.chunks.
write_chunk`) into the build's work directory, then `indexing.build.merge_index`
(the normal assembler: RecordWriter, IVF training, manifest, atomic publish). It is
streaming: memory stays at one chunk whatever `--docs` is.

Page mode (`--pages N`): N page records of exactly `--patches` (1030) 128-d vectors each, the
output of a ColPali-class model (1,024 patches of a 448-px page and 6 special tokens), so
135 KB a page in int8 (264 KB in fp16): 50,000 pages are 6.8 GB of records (13 GB). Chunks default to 256 pages
(about 135 MB of fp32 vectors while a chunk is drawn). The patches are drawn as the BOW
vectors are, from a real document's bag with jitter, so a page repeats near-identical
vectors as real pages repeat their background patches; where the source's vectors are
narrower than the request they are first carried into the wider space by a random
isometry (dot products unchanged; the jitter fills the other dimensions). The index is what
`espn index` makes of a ColPali-class model: pure MaxSim (`bow_reduction` "sum", w = 0), no
trained CLS vector (its CLS is the normalised mean of the page's patches, so the build gives it
the default first stage of such models), int8 records unless `--bow-dtype` says otherwise.
Queries are 8–24 token vectors (a short text query) drawn the same way, their CLS the mean.

Token mode (`--tokens`): `--docs` documents as a ColBERT-class model (ColBERT, PyLate) stores
them, built as page mode builds pages (128-d unit token vectors, pure MaxSim, no trained CLS,
the centroid first stage, `--bow-dtype` int8 or a residual kind), but each document's length is
drawn from the source index's real document lengths (give it a ColBERT-class index, such as
`benchmarks.bench_centroid_reads`'s `.espn/pf/index`: SciFact through PyLate, 157 vectors a
document on average). 2 M such documents are 314 M vectors: 41 GB of int8 records, 11 GB of
residual2, and the build's fp16 chunks (82 GB) on the way. Chunks default to 2,048 documents.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import SCIFACT_INDEX
from espn.choices import STORAGE_TYPES

log = logging.getLogger("make_synthetic")


def _pca(x: np.ndarray, d: int, sample: int = 200_000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(mean [D], components [D, d]) fitted on a sample of rows of x."""
    rng = np.random.default_rng(seed)
    rows = x if len(x) <= sample else x[rng.choice(len(x), sample, replace=False)]
    rows = rows.astype(np.float64)
    mean = rows.mean(0)
    cov = np.cov((rows - mean).T)
    vals, vecs = np.linalg.eigh(cov)
    return mean.astype(np.float32), vecs[:, ::-1][:, :d].astype(np.float32)


def _normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-6)


def _widen(x: np.ndarray, d: int, seed: int) -> np.ndarray:
    """x [N, D] carried into d >= D dimensions by a random isometry (orthonormal columns): norms and
    dot products are unchanged, so the geometry is the source's."""
    if x.shape[1] >= d:
        return x
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, x.shape[1])))  # [d, D]
    return (x @ q.T).astype(np.float32)


def load_centres(source: Path, d_cls: int, d_bow: int, project: bool = True,
                 widen: bool = False) -> dict[str, np.ndarray]:
    """Real CLS [C, d_cls] and flattened BOW [V, d_bow] (+ per-centre offsets) from a built index.

    project=False keeps the source encoder's own space (d_cls, d_bow: the source's).
    widen: a source narrower than d_cls or d_bow is carried into them (`_widen`) instead of refused."""
    from espn.index import IndexDirectory
    from espn.store import open_reader
    from espn.store.format import StoreLayout

    index = IndexDirectory.open(source)
    store = index.manifest["store"]
    layout = StoreLayout.from_manifest(store)
    records = index.load_array("records.npy")
    reader = open_reader("memory", index.file("embeddings.bin"), records, layout)
    n = len(records)
    cls_parts: list[np.ndarray] = []
    bow_parts: list[np.ndarray] = []
    count_parts: list[np.ndarray] = []
    for start in range(0, n, 512):
        batch = reader.read(np.arange(start, min(n, start + 512)))
        cls_parts.append(batch.cls.float().numpy())
        mask = batch.mask.numpy()
        bow_parts.append(batch.bow.float().numpy()[mask])
        count_parts.append(mask.sum(1))
    reader.close()
    cls = np.concatenate(cls_parts)
    bow = np.concatenate(bow_parts)
    counts = np.concatenate(count_parts).astype(np.int64)
    keep = counts > 0
    if project:
        mean_c, comp_c = _pca(cls, min(d_cls, cls.shape[1]))
        mean_b, comp_b = _pca(bow, min(d_bow, bow.shape[1]))
        cls_p = _normalize((cls - mean_c) @ comp_c)
        bow_p = _normalize((bow - mean_b) @ comp_b)
    else:
        cls_p, bow_p = _normalize(cls), _normalize(bow)
    if widen:
        cls_p, bow_p = _widen(cls_p, d_cls, seed=1), _widen(bow_p, d_bow, seed=2)
    if cls_p.shape[1] < d_cls or bow_p.shape[1] < d_bow:
        raise SystemExit(f"--source has d_cls={cls.shape[1]}, d_bow={bow.shape[1]}: too small for the request")
    offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return {"cls": cls_p[keep], "bow": bow_p, "start": offsets[:-1][keep], "count": counts[keep],
            "doc": np.flatnonzero(keep)}


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class TextMixer:
    """Passages for synthetic documents, recombined from the source index's passages: the title
    of the first source document, a run of its sentences, then a run of the second's (the
    two documents its CLS vector mixes), so the text and the vectors tell the same story."""

    def __init__(self, source: Path, docs: np.ndarray) -> None:
        from espn.text.directory import passages

        wanted = set(docs.tolist())
        self.titles: list[str] = []
        self.sentences: list[list[str]] = []
        for passage in passages(source):
            if passage.doc_number in wanted:
                self.titles.append(passage.title)
                self.sentences.append(_SENTENCE_END.split(passage.text.strip()) or [""])

    def passages(self, rng: np.random.Generator, first: np.ndarray, second: np.ndarray) -> tuple[list[str], list[str]]:
        titles, texts = [], []
        for a, b in zip(first.tolist(), second.tolist()):
            run_a, run_b = self._run(rng, self.sentences[a], 0.6), self._run(rng, self.sentences[b], 0.4)
            titles.append(self.titles[a])
            texts.append(" ".join(run_a + run_b))
        return titles, texts

    @staticmethod
    def _run(rng: np.random.Generator, sentences: list[str], share: float) -> list[str]:
        n = max(1, int(round(len(sentences) * share)))
        start = int(rng.integers(0, max(1, len(sentences) - n + 1)))
        return sentences[start : start + n]


def draw_counts(rng: np.random.Generator, n: int, mean: float, low: int, high: int) -> np.ndarray:
    """BOW vectors per passage: log-normal (sigma 0.45) with the given mean, clipped to [low, high]."""
    sigma = 0.45
    mu = np.log(mean) - sigma**2 / 2
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), low, high).astype(np.int64)


def draw(rng: np.random.Generator, centres: dict[str, np.ndarray], counts: np.ndarray, cls_noise: float,
         bow_noise: float, mix: float, sources: list[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CLS [n, d_cls] and flattened BOW [sum(counts), d_bow] (fp16) around random real centres; also the centres.

    sources: given a list, the two centres each document mixes are appended to it."""
    n = len(counts)
    c_cls, c_bow = centres["cls"], centres["bow"]
    first = rng.integers(0, len(c_cls), n)
    second = rng.integers(0, len(c_cls), n)
    if sources is not None:
        sources += [first, second]
    cls = c_cls[first] + mix * c_cls[second]
    cls += rng.standard_normal(cls.shape, dtype=np.float32) * (cls_noise / np.sqrt(cls.shape[1]))
    cls = _normalize(cls)
    owner = np.repeat(first, counts)
    pick = centres["start"][owner] + (rng.random(len(owner)) * centres["count"][owner]).astype(np.int64)
    bow = c_bow[pick]
    bow += rng.standard_normal(bow.shape, dtype=np.float32) * (bow_noise / np.sqrt(bow.shape[1]))
    bow = _normalize(bow)
    return cls.astype(np.float16), bow.astype(np.float16), first


def mean_vectors(bow: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[n, d] fp16: the normalised mean of each document's vectors (flattened bow, every count > 0), the
    CLS a model without a trained one stores."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return _normalize(np.add.reduceat(bow.astype(np.float32), starts, axis=0)).astype(np.float16)


def generate(out: Path, docs: int, source: Path, d_cls: int = 128, d_bow: int = 32, mean_bow: float = 30.0,
             min_bow: int = 8, max_bow: int = 120, queries: int = 2000, chunk_size: int = 16384,
             nlist: int | None = None, ann: str = "pq", pq_m: int = 32, seed: int = 0, force: bool = False,
             cls_noise: float = 1.5, bow_noise: float = 0.5, mix: float = 0.5, text: bool = False,
             source_encoder: bool = False, patches: int | None = None, bow_dtype: str = "int8",
             tokens: bool = False) -> dict:
    """patches: page mode, every document has exactly this many BOW vectors (the module's docstring).
    tokens: token mode, each document as long as a random one of the source's (the docstring).
    text: also write passages (`TextMixer`) and build the full-text index, and write the
    title of each query's centre document as its text (`OUT.query_texts.jsonl`).
    source_encoder: the vectors stay in the source index's space and the index takes its
    encoder (int8 records, as `espn index` writes them), so queries are encoded from text at
    search time, as in a real deployment; d_cls and d_bow are then the source's.
    bow_dtype: the records' dtype in page mode (the text modes keep theirs)."""
    from espn.encoders.precomputed import PrecomputedEncoder
    from espn.first_stage.build import PAGE_FIRST_STAGE
    from espn.files.durable import write_json_atomic
    from espn.index import update_manifest
    from espn.text.config import TextConfig
    from espn_indexing.build import merge_index
    from espn_indexing.chunks import write_chunk
    from espn_indexing.workdir import WorkDir

    out = Path(out).absolute()
    if out.exists() and not force:
        raise SystemExit(f"{out} exists; pass --force to replace it")
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    source_manifest = json.loads((Path(source) / "manifest.json").read_text())
    if source_encoder:
        d_cls, d_bow = source_manifest["encoder"]["d_cls"], source_manifest["encoder"]["d_bow"]
    if tokens and patches is not None:
        raise ValueError("page mode (patches) and token mode are two different corpora: choose one")
    maxsim = patches is not None or tokens  # pure MaxSim over 128-d unit vectors, as the models store them
    centres = load_centres(source, d_cls, d_bow, project=not source_encoder, widen=maxsim)
    log.info("%d real centres, %d real BOW vectors from %s", len(centres["cls"]), len(centres["bow"]), source)

    mixer = TextMixer(source, centres["doc"]) if text else None
    work = WorkDir(out)
    work.remove()
    with work.locked():
        job: dict = {"corpus": f"synthetic:{docs}:{seed}", "block_size": 4096, "nlist": nlist, "ann": ann,
                     "pq_m": pq_m, "text_index": TextConfig().to_json() if text else None}
        if source_encoder:
            shutil.copytree(Path(source) / "encoder", work.encoder_dir, dirs_exist_ok=True)
            job.update(encoder_config=source_manifest["encoder"], bow_dtype="int8")
        elif maxsim:  # a ColPali-class page index or a ColBERT-class one (the module's docstring)
            d_cls = d_bow
            encoder = PrecomputedEncoder(d_cls=d_cls, d_bow=d_bow, bow_reduction="sum", learned_weight=0.0,
                                         source="synthetic-tokens" if tokens else "synthetic-pages")
            encoder.save(work.encoder_dir)
            job.update(encoder_config={**encoder.config(), "has_trained_cls": False,
                                       "cls": "mean of the token vectors"}, bow_dtype=bow_dtype)
        else:
            encoder = PrecomputedEncoder(d_cls=d_cls, d_bow=d_bow, bow_reduction="mean", learned_weight=0.3,
                                         source="synthetic")
            encoder.save(work.encoder_dir)
            job["encoder_config"] = {**encoder.config(), "learned_weight": encoder.learned_weight,
                                     "bow_reduction": encoder.bow_reduction}
        write_json_atomic(work.job_file, job)
        n_chunks = -(-docs // chunk_size)
        total_bow = 0
        gen_started = time.perf_counter()
        for c in range(n_chunks):
            n = min(chunk_size, docs - c * chunk_size)
            counts = (np.full(n, patches, np.int64) if patches is not None
                      else rng.choice(centres["count"], n) if tokens
                      else draw_counts(rng, n, mean_bow, min_bow, max_bow))
            sources: list[np.ndarray] = []
            cls, bow, _ = draw(rng, centres, counts, cls_noise, bow_noise, mix, sources)
            if maxsim:
                cls = mean_vectors(bow, counts)
            ids = [f"d{i}" for i in range(c * chunk_size, c * chunk_size + n)]
            titles, texts = mixer.passages(rng, *sources) if mixer is not None else (None, None)
            write_chunk(work.path, c, cls, bow, counts, ids, titles, texts)
            total_bow += int(counts.sum())
            if c % 16 == 0 or c == n_chunks - 1:
                done = c * chunk_size + n
                log.info("generated %d/%d docs (%.0f docs/s)", done, docs, done / (time.perf_counter() - gen_started))
        gen_s = time.perf_counter() - gen_started
        write_json_atomic(work.marker(0, 1), {"shard": 0, "num_shards": 1, "documents": docs, "chunks": n_chunks})

    # Queries around the same centres: 8-24 BOW vectors, tighter jitter than documents.
    q_counts = rng.integers(8, 25, queries)
    q_cls, q_bow, q_centre = draw(rng, centres, q_counts, cls_noise * 0.8, bow_noise * 0.8, mix)
    if maxsim:
        q_cls = mean_vectors(q_bow, q_counts)
    queries_path = out.with_name(out.name + ".queries.npz")
    np.savez(queries_path, cls=q_cls.astype(np.float32), bow=q_bow.astype(np.float32), counts=q_counts,
             ids=np.array([f"q{i}" for i in range(queries)]), centre=q_centre)
    if mixer is not None:
        with open(out.with_name(out.name + ".query_texts.jsonl"), "w", encoding="utf-8") as f:
            for i, centre in enumerate(q_centre.tolist()):
                f.write(json.dumps({"_id": f"q{i}", "text": mixer.titles[centre]}) + "\n")

    asm_started = time.perf_counter()
    manifest = merge_index(out, force=force)
    if patches is not None and manifest.get("first_stage"):
        # what `espn index` gives an index of pages (its encoder reads images, these vectors do not)
        manifest = update_manifest(out, first_stage={**manifest["first_stage"], "probe": PAGE_FIRST_STAGE.probe,
                                                     "candidates": PAGE_FIRST_STAGE.candidates})
    asm_s = time.perf_counter() - asm_started
    info = {
        "out": str(out), "queries": str(queries_path), "documents": docs, "bow_vectors": total_bow,
        "mean_bow": total_bow / docs, "file_bytes": manifest["store"]["file_bytes"],
        "bow_bytes": total_bow * d_bow * 2, "nlist": manifest["ann"]["nlist"], "ann": ann,
        "generate_s": gen_s, "assemble_s": asm_s, "total_s": time.perf_counter() - started,
        "docs_per_s_generate": docs / gen_s, "docs_per_s_total": docs / (time.perf_counter() - started),
        "params": {"d_cls": d_cls, "d_bow": d_bow, "mean_bow": mean_bow, "min_bow": min_bow, "max_bow": max_bow,
                   "patches": patches, "tokens": tokens, "bow_dtype": bow_dtype if maxsim else None,
                   "cls_noise": cls_noise, "bow_noise": bow_noise, "mix": mix, "seed": seed, "source": str(source)},
    }
    (out.with_name(out.name + ".synthetic.json")).write_text(json.dumps(info, indent=1))
    return info


#: Values of the synthetic keyword field: each holds 0.1% of the documents.
SHARDS = 1000
#: The synthetic integer field is uniform over [0, RANK_RANGE).
RANK_RANGE = 1_000_000


def add_synthetic_metadata(index: Path, seed: int = 0) -> dict:
    """Two filter fields, drawn independently of the vectors (the hard case for an IVF):

    `shard`: keyword, uniform over "s000" .. "s999" (so `{"shard": {"in": [...m values]}}`
    keeps m/1000 of the documents); `rank`: integer, uniform over [0, 10^6) (so
    `{"rank": {"lt": s * 10^6}}` keeps a fraction s). Written as whole columns
    (`espn.metadata.write_columns`), then the manifest is rewritten with every checksum.
    """
    from espn.index import read_manifest, write_manifest
    from espn.metadata import write_columns

    manifest = read_manifest(index)
    n = int(manifest["counts"]["documents"])
    rng = np.random.default_rng(seed + 14)
    dictionary = np.array([f"s{i:03d}".encode() for i in range(SHARDS)], dtype="S4")
    section = write_columns(index, [
        ("shard", "keyword", {"codes": rng.integers(0, SHARDS, n, dtype=np.int32), "dict": dictionary}),
        ("rank", "integer", {"values": rng.integers(0, RANK_RANGE, n, dtype=np.int64),
                             "present": np.ones(n, dtype=bool)}),
    ])
    manifest["metadata"] = section
    write_manifest(index, manifest)
    return {"index": str(index), "documents": n, "metadata": section}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--add-metadata", type=Path, metavar="INDEX",
                   help="instead of generating: add the synthetic filter fields to an existing index (see "
                        "add_synthetic_metadata) and update its manifest")
    p.add_argument("--docs", type=int, default=2_000_000, help="documents (default 2M; 8841823 = MS MARCO v1)")
    p.add_argument("--quick", action="store_true", help="20,000 documents")
    p.add_argument("--pages", type=int, default=None, metavar="N",
                   help="page mode instead of --docs: N pages of --patches vectors each (--d-bow 128, --chunk-size 256 "
                        "unless given)")
    p.add_argument("--tokens", action="store_true",
                   help="token mode: --docs ColBERT-class documents, their lengths drawn from --source's (--d-bow 128, "
                        "--chunk-size 2048 unless given)")
    p.add_argument("--bow-dtype", choices=STORAGE_TYPES, default="int8",
                   help="page and token modes: the records' storage (int8, as `espn index` writes by default)")
    p.add_argument("--patches", type=int, default=1030, help="vectors per page in page mode (ColPali at 448 px: 1030)")
    p.add_argument("--source", type=Path, default=SCIFACT_INDEX, help="built index whose vectors give the geometry")
    p.add_argument("--queries", type=int, default=2000)
    p.add_argument("--d-cls", type=int, default=128)
    p.add_argument("--d-bow", type=int, default=None, help="default 32, 128 with --pages or --tokens")
    p.add_argument("--mean-bow", type=float, default=30.0)
    p.add_argument("--nlist", type=int, default=None, help="IVF lists (default: the assembler's, ~4*sqrt(N))")
    p.add_argument("--ann", choices=("flat", "pq"), default="pq",
                   help="IVF-PQ by default: an IVF-Flat of 128-d fp32 CLS would hold 0.5 KB/doc in RAM")
    p.add_argument("--chunk-size", type=int, default=None, help="default 16384, 256 with --pages, 2048 with --tokens")
    p.add_argument("--cls-noise", type=float, default=1.5, help="CLS jitter (norm of the noise vector)")
    p.add_argument("--bow-noise", type=float, default=0.5, help="BOW jitter (norm of the noise vector)")
    p.add_argument("--mix", type=float, default=0.5, help="weight of the second real centre in a CLS vector")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", action="store_true", help="also passages recombined from --source's and a full-text "
                   "index (for bench_hybrid and bench_text_engines)")
    p.add_argument("--source-encoder", action="store_true", help="keep the source's vector space and encoder: "
                   "queries are then searched as text (with --text: bench_hybrid latency with query texts)")
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    if args.add_metadata is not None:
        print(json.dumps(add_synthetic_metadata(args.add_metadata, seed=args.seed)))
        return 0
    if args.out is None:
        p.error("--out is required (or --add-metadata INDEX)")
    pages = args.pages is not None
    if pages and (args.pages < 1 or args.patches < 1):
        p.error("--pages and --patches must be positive")
    if pages and args.tokens:
        p.error("--pages and --tokens are two kinds of corpus: give one")
    docs = args.pages if pages else 20_000 if args.quick else args.docs
    d_bow = args.d_bow if args.d_bow is not None else 128 if pages or args.tokens else 32
    chunk_size = args.chunk_size if args.chunk_size is not None else 256 if pages else 2048 if args.tokens else 16384
    info = generate(args.out, docs, args.source, d_cls=args.d_cls, d_bow=d_bow, mean_bow=args.mean_bow,
                    queries=args.queries, chunk_size=chunk_size, nlist=args.nlist, ann=args.ann,
                    seed=args.seed, force=args.force, cls_noise=args.cls_noise, bow_noise=args.bow_noise, mix=args.mix,
                    text=args.text, source_encoder=args.source_encoder, patches=args.patches if pages else None,
                    bow_dtype=args.bow_dtype, tokens=args.tokens)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
