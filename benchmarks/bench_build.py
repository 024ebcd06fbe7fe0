"""Index build: end-to-end docs/s against the bare encoder, and peak RSS against corpus size.

    python -m benchmarks.bench_build                    # SciFact first 1000 docs, and them x4 (4000)
    python -m benchmarks.bench_build --docs 5183        # the whole SciFact corpus (and x4)
    python -m benchmarks.bench_build --quick            # 64 docs (and x4), 1 round

Two measurements per corpus, each in a fresh process, alternated over `--repeats` rounds:

- build: the real build job (`indexing.build`: fit the projection, `encode_corpus` with
  its DataLoader tokenising worker, `merge_index`), the same steps `espn index` runs.
  Reported: docs/s of the encode stage (the data path plus the model), docs/s of the
  whole job (fit + encode + assemble), and the peak RSS of the process tree
  (psutil, parent + DataLoader worker, sampled every 20 ms).
- bare: the encoder's forward pass alone (`embed_documents`) on the same documents,
  tokenised beforehand, in the same length-bucketed batches: the ceiling.

Targets: encode docs/s >= 0.9 x bare (the data path is never the bottleneck); peak RSS
of the x4 corpus (same documents repeated with unique ids) < 1.15 x that of the corpus
(memory does not grow with the corpus).
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import SCIFACT, machine, machine_line, markdown_table, median, write_results


def write_corpus(source: Path, out: Path, docs: int, repeat: int) -> Path:
    """The first `docs` documents of a BEIR corpus, `repeat` times with ids made unique."""
    opener = gzip.open if source.suffix == ".gz" else open
    rows = []
    with opener(source, "rt", encoding="utf-8") as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) >= docs:
                break
    with open(out, "w", encoding="utf-8") as f:
        for r in range(repeat):
            for row in rows:
                f.write(json.dumps({**row, "_id": f"{row['_id']}-{r}" if repeat > 1 else row["_id"]}) + "\n")
    return out


def child_build(corpus: Path, out: Path, batch_size: int, chunk_size: int) -> dict:
    from espn_indexing.build import BuildConfig, _prepare_encoder, merge_index
    from espn_indexing.encode import encode_corpus
    from espn_indexing.workdir import WorkDir
    from espn.files.durable import write_json_atomic

    config = BuildConfig(corpus=corpus, out=out, force=True, progress=False, batch_size=batch_size,
                         chunk_size=chunk_size).validate()
    t0 = time.perf_counter()
    work = WorkDir(out)
    work.remove()
    encoder = _prepare_encoder(config, work)
    t1 = time.perf_counter()
    totals = encode_corpus(corpus, work.path, encoder, chunk_size=config.chunk_size, batch_size=config.batch_size,
                           loader_workers=config.loader_workers, progress=False)
    t2 = time.perf_counter()
    write_json_atomic(work.marker(0, 1), {"shard": 0, "num_shards": 1, **totals})
    merge_index(out, force=True)
    t3 = time.perf_counter()
    n = totals["documents"]
    return {"documents": n, "fit_s": t1 - t0, "encode_s": t2 - t1, "assemble_s": t3 - t2, "total_s": t3 - t0,
            "encode_docs_per_s": n / (t2 - t1), "total_docs_per_s": n / (t3 - t0)}


def child_bare(corpus: Path, batch_size: int, chunk_size: int = 1024) -> dict:
    import torch

    from espn.corpus import iter_corpus
    from espn.encoders import encoder_from_spec

    texts = [d.full_text for d in iter_corpus(corpus)]
    encoder = encoder_from_spec("minilm", bow_dim=64)
    encoder.fit(texts[:256])
    batches = []
    for start in range(0, len(texts), chunk_size):  # the build's bucketing: sort each chunk by length
        chunk = texts[start : start + chunk_size]
        order = encoder.batch_order(chunk)
        for b in range(0, len(order), batch_size):
            batches.append(encoder.tokenize([chunk[i] for i in order[b : b + batch_size]], is_query=False))
    with torch.inference_mode():
        t = time.perf_counter()
        for tokens in batches:
            encoder.embed_documents(tokens)
        dt = time.perf_counter() - t
    return {"documents": len(texts), "forward_s": dt, "docs_per_s": len(texts) / dt}


def run_monitored(argv: list[str]) -> tuple[dict | None, int, str]:
    """Run a child; returns (its JSON, peak RSS of it + its children in bytes, stderr tail)."""
    import psutil

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        total = 0
        try:
            for p in [ps] + ps.children(recursive=True):
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        peak = max(peak, total)
        time.sleep(0.02)
    out, err = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if proc.returncode == 0 and lines else None), peak, err[-500:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=SCIFACT)
    p.add_argument("--docs", type=int, help="documents of the base corpus (SciFact has 5183; default 1000, --quick 16)")
    p.add_argument("--repeat", type=int, default=4, help="the large corpus = the base corpus this many times")
    p.add_argument("--repeats", type=int, default=2, help="rounds")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=1024,
                   help="documents per chunk (the build's default); keep the base corpus >= a few chunks, or the "
                        "RSS comparison measures a chunk filling up rather than the corpus growing")
    p.add_argument("--quick", action="store_true", help="16 documents (x2) unless --docs, 1 round, no bare run on the "
                                                        "larger corpus")
    p.add_argument("--name", default="build")
    p.add_argument("--child", choices=("build", "bare"), help=argparse.SUPPRESS)
    p.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child == "build":
        print(json.dumps(child_build(args.corpus, args.out, args.batch_size, args.chunk_size)))
        return 0
    if args.child == "bare":
        print(json.dumps(child_bare(args.corpus, args.batch_size, args.chunk_size)))
        return 0
    if args.quick:
        args.repeat, args.repeats = 2, 1
    args.docs = args.docs or (16 if args.quick else 1000)
    source = args.data / "corpus.jsonl.gz"
    if not source.is_file():
        source = args.data / "corpus.jsonl"
    info = machine()
    runs = []
    with tempfile.TemporaryDirectory(prefix="espn-bench-build-") as tmp:
        corpora = {"x1": write_corpus(source, Path(tmp) / "x1.jsonl", args.docs, 1),
                   f"x{args.repeat}": write_corpus(source, Path(tmp) / "xN.jsonl", args.docs, args.repeat)}
        for r in range(args.repeats):
            for label, corpus in corpora.items():
                kinds: tuple[str, ...] = ("bare", "build") if r % 2 == 0 else ("build", "bare")
                if args.quick and label != "x1":
                    kinds = ("build",)
                for kind in kinds:
                    cmd = [sys.executable, "-m", "benchmarks.bench_build", "--child", kind, "--corpus", str(corpus),
                           "--out", str(Path(tmp) / f"index-{label}"), "--batch-size", str(args.batch_size),
                           "--chunk-size", str(args.chunk_size)]
                    res, peak, err = run_monitored(cmd)
                    if res is None:
                        print(f"{kind} {label} failed: {err}", file=sys.stderr)
                        continue
                    runs.append({"round": r, "corpus": label, "kind": kind, "peak_rss": peak, **res})
                    print(f"round {r} {label} {kind}: {json.dumps(res)} peak {peak / 2**20:.0f} MiB", file=sys.stderr)

    def med(label: str, kind: str, key: str) -> float:
        return median([x[key] for x in runs if x["corpus"] == label and x["kind"] == kind and key in x])

    labels = list({x["corpus"]: None for x in runs})
    rows = []
    for label in labels:
        bare = med(label, "bare", "docs_per_s")
        enc = med(label, "build", "encode_docs_per_s")
        rows.append([label, int(med(label, "build", "documents")), bare, enc, enc / bare,
                     med(label, "build", "total_docs_per_s"), med(label, "build", "peak_rss") / 2**20,
                     med(label, "bare", "peak_rss") / 2**20])
    table = markdown_table(["corpus", "docs", "bare forward docs/s", "build encode docs/s", "encode ÷ bare (target >= 0.9)",
                            "whole job docs/s (fit+encode+assemble)", "build peak RSS MiB", "bare peak RSS MiB"], rows)
    growth = (med(labels[-1], "build", "peak_rss") / med(labels[0], "build", "peak_rss")) if len(labels) > 1 else float("nan")
    print(f"SciFact first {args.docs} docs (x1) and repeated {args.repeat}x with unique ids; {args.repeats} round(s), "
          f"batch {args.batch_size}, chunk {args.chunk_size}, CPU. Machine: {machine_line(info)}\n\n{table}\n\n"
          f"Peak RSS growth x1 -> x{args.repeat}: {100 * (growth - 1):.1f}% (target < 15%)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.bar([f"{l} bare" for l in labels] + [f"{l} build" for l in labels],
          [med(l, "bare", "docs_per_s") for l in labels] + [med(l, "build", "encode_docs_per_s") for l in labels])
    a.set_ylabel("docs/s")
    b.bar(labels, [med(l, "build", "peak_rss") / 2**20 for l in labels])
    b.set_ylabel("build peak RSS (MiB)")
    write_results(args.name, {"machine": info, "docs": args.docs, "repeat": args.repeat, "runs": runs,
                              "rss_growth": growth}, fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
