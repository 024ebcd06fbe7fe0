"""Indexes created empty over HTTP: how fast, and how good once filled by writes.

    python -m benchmarks.bench_create create --rounds 10 --work DIR
    python -m benchmarks.bench_create quality --work DIR \
        --model default=minilm --built default=SCIFACT_INDEX \
        --model colbert=colbert:/tmp/minilm-colbert --built colbert=SCIFACT_COLBERT_INDEX
    python -m benchmarks.bench_create quality --quick          # the CI smoke test (create takes --quick too)

create: `espn serve --index-root ROOT --model text=minilm --model pages=visual:CKPT` (the tiny
ColPali of benchmarks.make_visual_checkpoint), started with no index. The first creation of each
model (which loads it once and saves its files in the root) is timed apart; then `--rounds`
creations of each model, interleaved, POST /v1/indexes answered 201 (client-side wall time).
Beside it, in this process, the library call alone (espn.live.create.create_index with the
model's saved files, as the server calls it) and, in a fresh process each time, `espn create`
(interpreter, imports, model load and all).

quality: for each `--model NAME=SPEC`, an index created empty on a server of that model, then
the corpus written into it over HTTP (POST /v1/indexes/NAME/documents/batch, `--batch`
documents a request, one client), with the compaction policy the server runs; once the last
compaction has finished, `espn search --qrels` of it and of `--built NAME=INDEX` (the same
corpus through `espn index` with the same encoder): nDCG@10 of each, their ratio, and what each
stores. The created index is measured as the writes left it (a base and its deltas), and again
after `espn refit` (one fitted base, as a fresh build).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import (ROOT, SCIFACT, free_port, http, machine, machine_line, markdown_table, median,
                               read_jsonl, write_results)

BIN = Path(sys.executable).parent
HTTP_TIMEOUT_S = 900.0


@contextlib.contextmanager
def serve_root(root: Path, models: dict[str, str], log_path: Path) -> Iterator[str]:
    """`espn serve --index-root ROOT --model NAME=SPEC ...` (no default index) in its own session;
    yields its base URL once /readyz answers 200; always stops it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ESPN_")}
    command = [str(BIN / "espn"), "serve", "--index-root", str(root), "--port", str(port), "--log-level", "info",
               "--write-wait-s", "120", *[arg for name, spec in models.items() for arg in ("--model", f"{name}={spec}")]]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"espn serve exited {process.returncode}:\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(Exception):
                if http().get(f"{base}/readyz", timeout=10).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"espn serve not ready after 600 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(300)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def _post(base: str, path: str, body: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    response = http().post(base + path, json=body, timeout=HTTP_TIMEOUT_S)
    seconds = time.perf_counter() - started
    if response.status_code >= 300:
        raise RuntimeError(f"POST {path}: {response.status_code} {response.text[:500]}")
    return seconds, response.json()


def library_creations(root: Path, specs: dict[str, str], rounds: int) -> dict[str, Any]:
    """create_index with each model's saved files (what the server runs), `rounds` times, interleaved."""
    from espn.encoders import encoder_from_spec
    from espn.live.create import create_index, encoder_template

    out: dict[str, Any] = {}
    templates = {}
    for name, spec in specs.items():
        started = time.perf_counter()
        encoder = encoder_from_spec(spec, None)
        loaded = time.perf_counter()
        templates[name] = encoder_template(root, encoder)
        out[name] = {"load_s": loaded - started, "save_template_s": time.perf_counter() - loaded, "s": []}
    for i in range(rounds):
        for name in specs:
            started = time.perf_counter()
            create_index(root / f"lib-{name}-{i}", templates[name])
            out[name]["s"].append(time.perf_counter() - started)
    for row in out.values():
        row["p50_s"] = median(row["s"])
    return out


def cli_creations(work: Path, specs: dict[str, str], rounds: int) -> dict[str, Any]:
    """`espn create DIR --encoder SPEC` in a fresh process each time, interleaved."""
    out: dict[str, Any] = {name: {"s": []} for name in specs}
    for i in range(rounds):
        for name, spec in specs.items():
            started = time.perf_counter()
            subprocess.run([str(BIN / "espn"), "create", str(work / f"cli-{name}-{i}"), "--encoder", spec],
                           check=True, capture_output=True, timeout=900)
            out[name]["s"].append(time.perf_counter() - started)
    for row in out.values():
        row["p50_s"] = median(row["s"])
    return out


def run_create(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from benchmarks.make_visual_checkpoint import write_checkpoint

    specs = {"text": "minilm"}
    if not args.quick:  # the text model alone in a smoke test: the page model's first load is its slow part
        specs["pages"] = f"visual:{write_checkpoint(work / 'tiny-colpali')}"
    out: dict[str, Any] = {"models": specs}
    with serve_root(work / "served", specs, work / "server.log") as base:
        first = {name: _post(base, "/v1/indexes", {"name": f"first-{name}", "model": name})[0] for name in specs}
        times: dict[str, list[float]] = {name: [] for name in specs}
        for i in range(args.rounds):
            for name in specs:
                seconds, body = _post(base, "/v1/indexes", {"name": f"{name}-{i}", "model": name})
                assert body["documents"] == 0 and body["fit"]["exact"] is True, body
                times[name].append(seconds)
    out["http"] = {name: {"first_s": first[name], "s": times[name], "p50_s": median(times[name]),
                          "max_s": max(times[name])} for name in specs}
    out["library"] = library_creations(work / "library", specs, args.rounds)
    out["cli"] = cli_creations(work / "cli", specs, args.cli_rounds)
    return out


# -- quality -----------------------------------------------------------------------------------

def _espn(*argv: str) -> str:
    """The `espn` command run in this process (its console script's function); what it printed."""
    from espn.cli import main as espn_main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = espn_main([str(arg) for arg in argv])
    if status != 0:
        raise RuntimeError(f"espn {' '.join(map(str, argv))}: exit {status}\n{printed.getvalue()[-2000:]}")
    return printed.getvalue()


def _ndcg(index: Path, queries: Path, qrels: Path, run: Path) -> dict[str, float]:
    """`espn search INDEX --qrels` (all its measures, as it prints them)."""
    printed = _espn("search", index, "--queries", queries, "--qrels", qrels, "--out", run)
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+@\d+)\t([0-9.]+)$", printed, re.M)}


def _stored(index: Path) -> dict[str, Any]:
    """What an index stores: its records' token dimensions (a created index projects them at its first
    fit, espn.store.projection; a built one through its encoder's), pooling, and the bytes of its files
    (all generations' live files: a created index keeps its bases and deltas under live/)."""
    from espn.generation.format import read_current

    manifest = json.loads((index / "manifest.json").read_text())
    current = read_current(index)
    base = json.loads((index / current.base / "manifest.json").read_text())
    total = sum(p.stat().st_size for p in index.rglob("*") if p.is_file() and "encoder" not in p.parts)
    return {"d_bow": base["store"]["d_bow"],
            "projection": base["store"].get("projection") or manifest["encoder"].get("projection"),
            "pool_factor": base["store"].get("pool_factor", 1), "dtype": base["store"]["dtype"], "bytes_without_encoder": total,
            "embeddings_bytes": current.embeddings_bytes,  # the base's records and its deltas' after them
            "documents": current.live_documents, "deltas": len(current.segments)}


def _wait_for_compaction(base: str, name: str) -> dict[str, Any]:
    while True:
        info = http().get(f"{base}/v1/indexes/{name}", timeout=60).json()
        if info.get("fit") and info["fit"].get("refit_running") is None:
            return info
        time.sleep(2)


def run_quality(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    models = dict(item.split("=", 1) for item in args.model)
    built = {name: Path(path) for name, path in (item.split("=", 1) for item in args.built)}
    documents = read_jsonl(args.corpus, args.limit)
    out: dict[str, Any] = {"documents": len(documents), "batch": args.batch, "models": models, "rows": {}}
    for name, spec in models.items():
        root = work / f"root-{name}"
        shutil.rmtree(root, ignore_errors=True)
        row: dict[str, Any] = {}
        with serve_root(root, {name: spec}, work / f"server-{name}.log") as base:
            row["create_s"] = _post(base, "/v1/indexes", {"name": name, "model": name})[0]
            started = time.perf_counter()
            for at in range(0, len(documents), args.batch):
                upserts = [{"id": d["_id"], "title": d.get("title", ""), "text": d["text"]}
                           for d in documents[at : at + args.batch]]
                _post(base, f"/v1/indexes/{name}/documents/batch", {"upsert": upserts})
            row["write_s"] = time.perf_counter() - started
            row["docs_per_s"] = len(documents) / row["write_s"]
            row["info_after_writes"] = _wait_for_compaction(base, name)
        created = root / name
        row["created"] = {"stored": _stored(created),
                          "measures": _ndcg(created, args.queries, args.qrels, work / f"run-{name}-created.trec")}
        started = time.perf_counter()
        _espn("refit", created)
        row["refit_s"] = time.perf_counter() - started
        row["refitted"] = {"stored": _stored(created),
                           "measures": _ndcg(created, args.queries, args.qrels, work / f"run-{name}-refit.trec")}
        if name in built:
            row["built"] = {"path": str(built[name]), "stored": _stored(built[name]),
                            "measures": _ndcg(built[name], args.queries, args.qrels, work / f"run-{name}-built.trec")}
            for state in ("created", "refitted"):
                row[f"{state}_over_built"] = row[state]["measures"]["nDCG@10"] / row["built"]["measures"]["nDCG@10"]
        out["rows"][name] = row
        print(f"{name}: {json.dumps(row, default=str)[:2000]}", file=sys.stderr, flush=True)
    return out


def report_create(out: dict[str, Any]) -> str:
    rows = []
    for name in out["models"]:
        h, lib, cli = out["http"][name], out["library"][name], out["cli"][name]
        rows.append([name, out["models"][name].split(":")[0], h["first_s"], h["p50_s"], h["max_s"], lib["p50_s"],
                     lib["load_s"] + lib["save_template_s"], cli["p50_s"]])
    return markdown_table(["model", "encoder", "POST first s", "POST p50 s", "POST max s", "library p50 s",
                           "library: load + save once s", "espn create p50 s"], rows)


def report_quality(out: dict[str, Any]) -> str:
    rows = []
    for name, row in out["rows"].items():
        for state in ("created", "refitted", "built"):
            if state not in row:
                continue
            stored = row[state]["stored"]
            ratio = row.get(f"{state}_over_built", 1.0 if state == "built" else float("nan"))
            rows.append([name, {"created": "written over HTTP", "refitted": "written, then espn refit",
                                "built": "espn index"}[state], row[state]["measures"].get("nDCG@10", float("nan")),
                         ratio, stored["d_bow"], stored.get("pool_factor", 1), stored["dtype"], stored["deltas"],
                         f"{stored['embeddings_bytes'] / 1e6:.1f}", f"{stored['bytes_without_encoder'] / 1e6:.1f}"])
    return markdown_table(["model", "index", "nDCG@10", "÷ espn index", "stored d", "pool", "dtype", "deltas",
                           "records MB", "all files MB"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", choices=("create", "quality"))
    p.add_argument("--rounds", type=int, default=10, help="create: creations of each model over HTTP and in-process")
    p.add_argument("--cli-rounds", type=int, default=5, help="create: `espn create` runs of each model")
    p.add_argument("--model", action="append", default=[], metavar="NAME=SPEC", help="quality: a model to create with")
    p.add_argument("--built", action="append", default=[], metavar="NAME=INDEX",
                   help="quality: `espn index` of the same corpus with that model")
    p.add_argument("--corpus", type=Path, default=SCIFACT / "corpus.jsonl.gz")
    p.add_argument("--queries", type=Path, default=SCIFACT / "queries.jsonl")
    p.add_argument("--qrels", type=Path, default=SCIFACT / "qrels" / "test.tsv")
    p.add_argument("--limit", type=int, default=None, help="quality: the first N documents of the corpus")
    p.add_argument("--batch", type=int, default=64, help="quality: documents per write request")
    p.add_argument("--work", type=Path, help="where indexes go (default: a temporary directory, removed after)")
    p.add_argument("--quick", action="store_true", help="the CI smoke test: create: 2 creations of the text model, no "
                   "`espn create`; quality: 40 documents of the bundled sample corpus")
    args = p.parse_args(argv)
    if args.quick:
        data = ROOT / "espn" / "data"
        args.rounds, args.cli_rounds, args.limit, args.batch = 2, 0, 40, 16
        args.corpus, args.queries, args.qrels = data / "sample_corpus.jsonl", data / "sample_queries.jsonl", \
            data / "sample_qrels.tsv"
        args.model = args.model or ["text=minilm"]
    if args.study == "quality" and not args.model:
        p.error("quality needs --model NAME=SPEC (and --built NAME=INDEX to compare with)")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-create-"))
    work.mkdir(parents=True, exist_ok=True)
    info = machine()
    try:
        result = run_create(args, work) if args.study == "create" else run_quality(args, work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print(machine_line(info))
    print(report_create(result) if args.study == "create" else report_quality(result))
    name = f"create_{args.study}" + ("_quick" if args.quick else "".join(
        f"_{model.split('=')[0]}" for model in args.model) if args.study == "quality" else "")
    write_results(name, {"machine": info, **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
