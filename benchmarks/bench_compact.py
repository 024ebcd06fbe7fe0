"""Compact records: pool factor x storage type on SciFact, footprint against quality and latency.

    python -m benchmarks.bench_compact --index .espn/scifact-index --work /tmp/espn-compact
    python -m benchmarks.bench_compact --index .espn/scifact-index --work /tmp/espn-compact --quick

`--index` is a SciFact index built with `--pool-factor 1 --bow-dtype float16` (or any
format 1 index): its records hold every document's token vectors exactly as the encoder
gave them (fp16, as the build's chunk files do), so the corpus is encoded once. The script
turns them back into the build job's chunk files (WORK/encoded.partial), then runs the
build's own assemble stage once per setting (pooling, quantisation, IVF, manifest: the
"assemble s" column; the encode stage is the same for every setting) and publishes each
index to WORK/pool{F}-{dtype}.

Then every index answers the same pre-encoded queries: the test split (nDCG@10, and
single-query latency, batch 1, prefetch on, with the posix and the memory reader; rounds
in shuffled order, the median of each round's p50) and the train split (nDCG@10, the
numbers the defaults are chosen on).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import SCIFACT, machine, machine_line, markdown_table, median, take_queries, write_results

SETTINGS = "1:float16,1:int8,2:float16,2:int8,3:float16,3:int8,4:int8"
READERS = ("posix", "memory")
#: The row of the source index itself (format 1, fp16, unpooled: what the build wrote before).
TODAY = (1, "float16 today")


def export_chunks(index: Path, work_out: Path, chunk_size: int = 1024) -> Path:
    """The build job's work dir (chunks, encoder, job.json, shard marker) from an unpooled fp16 index."""
    from espn.files.durable import write_json_atomic
    from espn.index import DocStore, IndexDirectory
    from espn.store import open_reader
    from espn.store.format import StoreLayout

    from indexing.chunks import write_chunk
    from indexing.workdir import WorkDir

    source = IndexDirectory.open(index, verify="none")
    store = source.manifest["store"]
    layout = StoreLayout.from_manifest(store)
    if layout.dtype != "float16" or layout.pool_factor != 1:
        raise SystemExit(f"{index}: needs an index of unpooled fp16 records (it has {layout.dtype}, "
                         f"pool factor {layout.pool_factor})")
    work = WorkDir(work_out)
    if (work.path / "shards" / "0-of-1.json").is_file():
        return work.path
    work.remove()
    records = source.load_array("records.npy")
    ids = source.load_array("ids.npy")
    docs = DocStore(source.file("docs.jsonl"), source.load_array("docs_offsets.npy"))
    n = len(records)
    with open_reader("memory", source.file("embeddings.bin"), records, layout) as reader:
        for c, start in enumerate(range(0, n, chunk_size)):
            rows = np.arange(start, min(n, start + chunk_size))
            batch = reader.read(rows)
            texts = [docs.get(int(i)) for i in rows]
            write_chunk(work.path, c, batch.cls.numpy(), batch.vectors.numpy(), batch.n_bow,
                        [bytes(x).decode() for x in ids[rows]], [t for t, _ in texts], [x for _, x in texts])
    shutil.copytree(source.file("encoder"), work.encoder_dir)
    manifest = source.manifest
    write_json_atomic(work.job_file, {
        "corpus": manifest["source"]["corpus"], "block_size": layout.block_size, "nlist": manifest["ann"]["nlist"],
        "ann": manifest["ann"]["kind"], "pq_m": manifest["ann"]["pq_m"] or 32, "encoder_config": manifest["encoder"],
        "w": manifest["score"]["w"] if manifest["score"].get("calibrated") else None,
    })
    write_json_atomic(work.marker(0, 1), {"shard": 0, "num_shards": 1, "documents": n,
                                          "chunks": -(-n // chunk_size)})
    return work.path


def scale_errors(encoded: Path, docs: int = 400, seed: int = 0) -> list[list]:
    """int8 error of per-vector against per-dimension absmax scales on stored BOW vectors.

    Rows: (scheme, mean relative L2 error, rms error of dot products with 2,000 other stored
    vectors); `docs` random documents of the first chunk.
    """
    from espn.store.format import quantize_int8

    from indexing.chunks import read_chunk

    chunk = read_chunk(encoded, 0)
    rng = np.random.default_rng(seed)
    ends = np.cumsum(chunk.counts)
    picked = rng.choice(len(chunk.counts), size=min(docs, len(chunk.counts)), replace=False)
    x = np.concatenate([chunk.bow[e - c: e] for e, c in zip(ends[picked], chunk.counts[picked])]).astype(np.float32)
    probes = x[rng.choice(len(x), size=min(2000, len(x)), replace=False)]
    codes, scales = quantize_int8(x)
    per_vector = codes * scales.astype(np.float32)[:, None]
    step = np.abs(x).max(axis=0) / 127
    per_dim = np.rint(x / step) * step
    rows = []
    for name, approx in (("per vector (stored)", per_vector), ("per dimension", per_dim)):
        rel = np.linalg.norm(approx - x, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-12)
        rows.append([name, float(rel.mean()), float(np.sqrt(np.mean((probes @ approx.T - probes @ x.T) ** 2)))])
    return rows


def assemble_setting(encoded: Path, out: Path, pool_factor: int, dtype: str) -> float:
    """Assemble one setting from the shared chunks; seconds taken."""
    from espn.files.durable import write_json_atomic

    from indexing.assemble import assemble, publish
    from indexing.workdir import WorkDir

    work = WorkDir(encoded.with_name(encoded.name[: -len(".partial")]))
    job = json.loads(work.job_file.read_text())
    write_json_atomic(work.job_file, {**job, "pool_factor": pool_factor, "bow_dtype": dtype})
    staging = work.path / "staging"
    started = time.perf_counter()
    assemble(work, staging)
    seconds = time.perf_counter() - started
    publish(staging, out, force=True)
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, required=True, help="SciFact index with unpooled fp16 records")
    p.add_argument("--work", type=Path, required=True, help="where the encoded chunks and the indexes go")
    p.add_argument("--data", type=Path, default=SCIFACT)
    p.add_argument("--settings", default=SETTINGS, help="pool_factor:dtype,... (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="latency rounds")
    p.add_argument("--reuse", action="store_true", help="keep indexes already assembled in --work")
    p.add_argument("--quick", action="store_true", help="two settings, 30 test queries, 1 round, no train split")
    p.add_argument("--scales-only", action="store_true", help="only the int8 scale comparison")
    p.add_argument("--name", default="compact")
    args = p.parse_args(argv)
    settings = [(int(f), d) for f, d in (s.split(":") for s in args.settings.split(","))]
    if args.quick:
        settings, args.repeats = settings[:2], 1

    from espn import Searcher
    from espn.corpus import read_qrels, read_queries
    from espn.evaluation import evaluate

    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    encoded = export_chunks(args.index, args.work / "encoded")
    print(f"chunks ready in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    scales = scale_errors(encoded)
    print("# int8 scales on stored SciFact BOW vectors (400 documents)")
    print(markdown_table(["scale", "mean relative L2 error", "dot-product error rms"], scales))
    if args.scales_only:
        return 0
    built: dict[tuple[int, str], dict] = {}
    for factor, dtype in settings:
        out = args.work / f"pool{factor}-{dtype}"
        info_file = out.with_name(out.name + ".assemble.json")
        if args.reuse and (out / "manifest.json").is_file() and info_file.is_file():
            built[(factor, dtype)] = json.loads(info_file.read_text())
            continue
        seconds = assemble_setting(encoded, out, factor, dtype)
        built[(factor, dtype)] = {"assemble_s": seconds}
        info_file.write_text(json.dumps(built[(factor, dtype)]))
        print(f"pool {factor} {dtype}: assembled in {seconds:.1f}s", file=sys.stderr)

    # The source index is the first row: today's default, as built before this change.
    paths = {TODAY: args.index, **{s: args.work / f"pool{s[0]}-{s[1]}" for s in settings}}
    settings = [TODAY, *settings]
    built[TODAY] = {"assemble_s": float("nan")}
    searchers = {(s, r): Searcher.open(paths[s], reader=r, verify="none", with_encoder=(s, r) == (TODAY, "posix"))
                 for s in settings for r in READERS}
    encoder_searcher = searchers[(TODAY, "posix")]
    splits = {"test": read_qrels(args.data / "qrels" / "test.tsv")}
    if not args.quick:
        splits["train"] = read_qrels(args.data / "qrels" / "train.tsv")
    texts = dict(read_queries(args.data / "queries.jsonl"))
    encoded_queries = {}
    for split, qrels in splits.items():
        qids = [q for q in texts if q in qrels][: 30 if args.quick else None]
        assert encoder_searcher.encoder is not None
        encoded_queries[split] = (qids, encoder_searcher.encoder.encode_queries([texts[q] for q in qids]))

    def run(searcher, split: str, batch: int) -> tuple[dict, list[float], list]:
        qids, queries = encoded_queries[split]
        results, latencies = [], []
        for start in range(0, len(qids), batch):
            chunk = take_queries(queries, np.arange(start, min(start + batch, len(qids))))
            t = time.perf_counter()
            results.extend(searcher.search_embeddings(chunk, k=10))
            latencies.append((time.perf_counter() - t) * 1000)
        run_ = {q: {h.doc_id: h.score for h in r.hits} for q, r in zip(qids, results)}
        return evaluate(run_, splits[split]), latencies, [r.stats for r in results]

    quality: dict[tuple[int, str], dict] = {}
    for s in settings:
        quality[s] = {split: run(searchers[(s, "memory")], split, 32)[0]["nDCG@10"] for split in splits}
        print(f"pool {s[0]} {s[1]}: {quality[s]}", file=sys.stderr)
    warm = take_queries(encoded_queries["test"][1], np.arange(16))
    for searcher in searchers.values():  # warm up: first calls pay allocation and page-in
        for i in range(16):
            searcher.search_embeddings(take_queries(warm, np.array([i])), k=10)
    cells = [(s, r) for s in settings for r in READERS]
    p50s: dict[tuple, list[float]] = {c: [] for c in cells}
    kb_read: dict[tuple, float] = {}
    rng = random.Random(0)
    for _ in range(args.repeats):
        order = cells[:]
        rng.shuffle(order)
        for cell in order:
            _, latencies, stats = run(searchers[cell], "test", 1)
            p50s[cell].append(float(np.percentile(latencies, 50)))
            kb_read[cell] = float(np.mean([st.bytes_read for st in stats])) / 1024

    base_bytes = (args.index / "embeddings.bin").stat().st_size
    rows, payload = [], []
    for s in settings:
        index = paths[s]
        manifest = json.loads((index / "manifest.json").read_text())
        n = manifest["counts"]["documents"]
        size = (index / "embeddings.bin").stat().st_size
        records = np.load(index / "records.npy")
        posix, memory = median(p50s[(s, "posix")]), median(p50s[(s, "memory")])
        row = {"pool_factor": s[0], "dtype": s[1], "index": str(index), "vectors_per_doc": manifest["counts"]["bow_vectors"] / n,
               "record_bytes_per_doc": float(records["length"].mean()), "file_bytes_per_doc": size / n,
               "embeddings_mb": size / 1e6, "cut": base_bytes / size, "ndcg10_test": quality[s]["test"],
               "ndcg10_train": quality[s].get("train", float("nan")), "p50_posix_ms": posix, "p50_memory_ms": memory,
               "posix_over_memory": posix / memory, "kb_read_per_query": kb_read[(s, "posix")],
               "assemble_s": built[s]["assemble_s"]}
        payload.append(row)
        rows.append([s[0], s[1], row["vectors_per_doc"], row["record_bytes_per_doc"], row["file_bytes_per_doc"],
                     row["embeddings_mb"], row["cut"], row["ndcg10_train"], row["ndcg10_test"], posix, memory,
                     row["posix_over_memory"], row["kb_read_per_query"], row["assemble_s"]])
    print(f"# Compact records on SciFact ({len(encoded_queries['test'][0])} test queries, "
          f"{args.repeats} latency rounds; cut against {args.index.name}, today's default)")
    print(machine_line(machine()))
    print(markdown_table(["pool", "dtype", "vectors/doc", "record B/doc", "file B/doc", "embeddings.bin MB", "cut ×",
                          "nDCG@10 train", "nDCG@10 test", "p50 posix ms", "p50 memory ms", "posix ÷ memory",
                          "KB read/query", "assemble s"], rows))
    write_results(args.name, {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                              "rows": payload, "scales": scales, "p50_rounds": {f"{s[0]}/{s[1]}/{r}": v for (s, r), v in p50s.items()}})
    for searcher in searchers.values():
        searcher.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
