"""The live index in production: descriptors, write rate, its cost to searches, compaction, deletes.

    python -m benchmarks.bench_writes --index .espn/scifact-index --large /data/synth2m
    python -m benchmarks.bench_writes --index INDEX --corpus CORPUS --queries QUERIES --quick

INDEX (and LARGE) are never modified: the script works on a copy in --work (LARGE's copy
hard-links its big files, which a delete never writes; only live/ is new). One run, in
order, so that every ratio is measured side by side:

1. encode rate: the build's encode stage (`encode_corpus`, chunk files, all cores) on the
   documents the writers will write, in this process before any server runs: docs/s.
2. `espn serve COPY --workers 2` under `ulimit -n 1024`; the descriptors of each worker,
   then `--puts` sequential single-document PUTs (status counts; descriptors again).
3. searches alone: `--searchers` closed-loop clients for `--seconds`: search p50/p99.
4. writes alone: `--writers` concurrent clients of single-document PUTs: writes/s (against
   the encode rate of 1.), write p50/p99.
5. writes and searches together: both, for `--seconds`: search p50/p99 against 3.
6. writes while compactions run: the writers again, with base rewrites (`LiveIndex.compact`
   in this process, as `espn compact` would run beside a server) back to back, against
   the writes of 4.
7. deletes on LARGE: `--deletes` single-id deletes through `LiveIndex` (the library the
   server calls): bytes written per delete (the write() bytes of this process, and the
   size of the files each leaves) and p50/p99 ms.

Not a test: it prints the tables the docs quote (docs/benchmarks/live-index.md). The clients run on the same machine
as the server, and the machine may be shared: the load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench_server import serve, worker_processes
from benchmarks.common import ROOT, SCIFACT, SCIFACT_INDEX, machine, machine_line, markdown_table, percentiles, \
    read_jsonl, write_results

FD_LIMIT = 1024



def encode_rate(documents: list[dict[str, Any]], index: Path, work: Path) -> float:
    """docs/s of the build's encode stage on `documents` (the index's encoder, all cores)."""
    from espn.encoders import load_encoder
    from espn.index import read_manifest
    from espn_indexing.encode import encode_corpus

    corpus = work / "encode.jsonl"
    corpus.write_text("".join(json.dumps({"_id": f"e{i}", "title": d.get("title", ""), "text": d["text"]}) + "\n"
                              for i, d in enumerate(documents)))
    encoder = load_encoder(index / "encoder", read_manifest(index)["encoder"], device="cpu")
    started = time.perf_counter()
    encode_corpus(corpus, work / "encode-chunks", encoder, loader_workers=1, progress=False)
    return len(documents) / (time.perf_counter() - started)


class Load:
    """Closed-loop clients (writers or searchers) on threads, each recording (start, seconds, status)."""

    def __init__(self, base: str, kind: str, clients: int, documents: list[dict[str, Any]], queries: list[str],
                 label: str = "") -> None:
        self.base, self.kind, self.clients, self.label = base, kind, clients, label or kind
        self.documents, self.queries = documents, queries
        self.samples: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._counter = iter(range(1 << 40))
        self._lock = threading.Lock()

    def _request(self, client: httpx.Client, n: int) -> httpx.Response:
        if self.kind == "write":
            doc = self.documents[n % len(self.documents)]
            return client.put(f"/v1/documents/{self.label}-{n}", json={"title": doc.get("title", ""), "text": doc["text"]})
        return client.post("/v1/search", json={"query": self.queries[n % len(self.queries)], "k": 10})

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=300) as client:
            while not self._stop.is_set():
                with self._lock:
                    n = next(self._counter)
                started = time.perf_counter()
                try:
                    status = self._request(client, n).status_code
                except httpx.HTTPError:
                    status = 599
                self.samples.append((started, time.perf_counter() - started, status))

    def start(self) -> "Load":
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(self.clients)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def window(self, start: float, stop: float) -> dict[str, Any]:
        """Requests that started in [start, stop): rate, latency percentiles (ms), status counts."""
        inside = [s for s in self.samples if start <= s[0] < stop]
        statuses: dict[str, int] = {}
        for _, _, status in inside:
            statuses[str(status)] = statuses.get(str(status), 0) + 1
        ok = [seconds * 1000 for _, seconds, status in inside if status < 300]
        return {"per_s": len(ok) / max(1e-9, stop - start), "ms": percentiles(ok), "statuses": statuses,
                "errors_5xx": sum(n for s, n in statuses.items() if s.startswith("5"))}


def measure(duration: float, *loads: Load) -> tuple[float, float]:
    """Run `loads` for `duration` seconds (after a short ramp); the measured window."""
    for load in loads:
        load.start()
    time.sleep(min(2.0, duration / 4))
    start = time.perf_counter()
    time.sleep(duration)
    stop = time.perf_counter()
    for load in loads:
        load.stop()
    return start, stop


def live_copy(source: Path, target: Path, link_over: int = 64 << 20) -> None:
    """A copy to write deltas and tombstones into: files over `link_over` bytes are hard links
    (a delete never writes them; compaction is not run on this copy)."""
    for path in sorted(source.rglob("*")):
        out = target / path.relative_to(source)
        if path.is_dir():
            out.mkdir(parents=True, exist_ok=True)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        if path.stat().st_size > link_over:
            try:
                os.link(path, out)
                continue
            except OSError:
                pass
        shutil.copy2(path, out)


def _written_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def deletes(large: Path, work: Path, count: int) -> dict[str, Any]:
    """`count` single-id deletes on a live copy of `large`: ms and bytes written each."""
    import numpy as np

    from espn.index import IdMap, IndexDirectory
    from espn.live.live_index import LiveIndex

    copy = work / "large"
    shutil.rmtree(copy, ignore_errors=True)
    live_copy(large, copy)
    base = IndexDirectory(copy, {})
    ids = IdMap(base.load_array("ids.npy"), base.load_array("ids_sorted.npy"))
    rows = np.random.default_rng(0).choice(len(ids.ids), size=count, replace=False)
    doomed = ids.external(rows.tolist())
    writer = LiveIndex(copy)
    times, written, files = [], [], []
    for doc_id in doomed:
        before_files = {p: p.stat().st_size for p in (copy / "live").glob("*")} if (copy / "live").is_dir() else {}
        wrote = _written_bytes()
        started = time.perf_counter()
        writer.delete([doc_id])
        times.append((time.perf_counter() - started) * 1000)
        written.append(_written_bytes() - wrote)
        after = {p: p.stat().st_size for p in (copy / "live").glob("*") if p.is_file()}
        files.append(sum(size for p, size in after.items() if before_files.get(p) != size))
    current = writer.current()
    return {"documents": current.base_documents, "deletes": count, "ms": percentiles(times),
            "write_bytes": percentiles(written), "new_file_bytes": percentiles(files),
            "max_write_bytes": max(written), "tombstone_files": len(current.tombstones),
            "generation_record_bytes": (copy / "live" / current.file_name).stat().st_size}


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-writes-"))
    work.mkdir(parents=True, exist_ok=True)
    index = work / "index"
    shutil.rmtree(index, ignore_errors=True)
    shutil.copytree(args.index, index)
    documents = read_jsonl(args.corpus, args.documents)
    queries = [q["text"] for q in read_jsonl(args.queries, 200)]
    random.Random(0).shuffle(queries)
    out: dict[str, Any] = {"machine": machine(), "index": str(args.index), "large": str(args.large),
                           "settings": {k: v for k, v in vars(args).items() if k not in ("index", "large", "work")}}
    out["encode_docs_per_s"] = encode_rate(documents[: args.encode_docs], index, work)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(FD_LIMIT, hard), hard))  # inherited by the server
    try:
        with serve(index, 2, ["--write-wait-s", "60"], work / "server.log") as (base, supervisor):
            workers = worker_processes(supervisor)
            with httpx.Client(base_url=base, timeout=300) as client:
                client.post("/v1/search", json={"query": queries[0], "k": 10})
                fds_before = {w.pid: w.num_fds() for w in workers}
                statuses: dict[str, int] = {}
                for i in range(args.puts):
                    doc = documents[i % len(documents)]
                    status = client.put(f"/v1/documents/seq-{i}", json={"text": doc["text"]}).status_code
                    statuses[str(status)] = statuses.get(str(status), 0) + 1
                for _ in range(4):  # both workers serve a search and open the newest generation
                    client.post("/v1/search", json={"query": queries[1], "k": 10})
                fds_after = {w.pid: w.num_fds() for w in workers}
            out["sequential_puts"] = {"puts": args.puts, "statuses": statuses, "fd_limit": FD_LIMIT,
                                      "fds_before": fds_before, "fds_after": fds_after,
                                      "fd_growth_max": max(fds_after[p] - fds_before[p] for p in fds_before)}

            searchers = Load(base, "search", args.searchers, documents, queries)
            out["search_alone"] = searchers.window(*measure(args.seconds, searchers))
            writers = Load(base, "write", args.writers, documents, queries, "alone")
            out["writes_alone"] = writers.window(*measure(args.seconds, writers))
            mixed_w = Load(base, "write", args.writers, documents, queries, "mixed")
            mixed_s = Load(base, "search", args.searchers, documents, queries)
            window = measure(args.seconds, mixed_w, mixed_s)
            out["mixed"] = {"writes": mixed_w.window(*window), "searches": mixed_s.window(*window)}
            searchers = Load(base, "search", args.searchers, documents, queries)
            out["search_alone_after"] = searchers.window(*measure(args.seconds, searchers))
            out["compaction"] = compaction_window(base, index, args, documents, queries)
            out["server_log_tracebacks"] = (work / "server.log").read_text(errors="replace").count("Traceback")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if args.large is not None:
        out["deletes"] = deletes(args.large, work, args.deletes)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return out


def compaction_window(base: str, index: Path, args: argparse.Namespace, documents: list, queries: list) -> dict:
    """Writers for --seconds without compaction, then for --seconds with base rewrites back to back."""
    from espn.live.live_index import LiveIndex

    writers = Load(base, "write", args.writers, documents, queries, "compaction").start()
    time.sleep(min(2.0, args.seconds / 4))
    quiet = (time.perf_counter(), time.perf_counter() + args.seconds)
    time.sleep(args.seconds)
    compactions, busy = [], []
    started = time.perf_counter()
    while time.perf_counter() - started < args.seconds or not compactions:
        began = time.perf_counter()
        LiveIndex(index).compact(wait_s=60)
        compactions.append(time.perf_counter() - began)
        busy.append((began, time.perf_counter()))
    writers.stop()
    during = [s for s in writers.samples if any(a <= s[0] < b for a, b in busy)]
    ok = [seconds * 1000 for _, seconds, status in during if status < 300]
    return {"without": writers.window(*quiet), "during": {"ms": percentiles(ok), "writes": len(during),
            "errors_5xx": sum(1 for s in during if s[2] >= 500)}, "compactions": len(compactions),
            "compaction_s": percentiles(compactions)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, default=SCIFACT_INDEX, help="index to copy and serve (never modified)")
    p.add_argument("--corpus", type=Path, default=SCIFACT / "corpus.jsonl.gz", help="where written documents come from")
    p.add_argument("--queries", type=Path, default=SCIFACT / "queries.jsonl", help="queries the searchers send")
    p.add_argument("--large", type=Path, help="a large index for the delete measurement (a hard-linked live copy)")
    p.add_argument("--work", type=Path, help="where copies go (default: a temporary directory, removed after)")
    p.add_argument("--documents", type=int, default=2000, help="distinct documents the writers cycle through")
    p.add_argument("--encode-docs", type=int, default=300, help="documents the encode-rate baseline encodes")
    p.add_argument("--puts", type=int, default=1000, help="sequential single-document PUTs (descriptor check)")
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--searchers", type=int, default=6)
    p.add_argument("--seconds", type=float, default=60.0, help="length of each measured window")
    p.add_argument("--deletes", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="tiny sizes, short windows (for the CI smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.documents, args.encode_docs, args.puts, args.seconds, args.deletes = 64, 8, 12, 1.0, 5
    out = run(args)
    print(report(out, args))
    write_results("bench_writes" + ("_quick" if args.quick else ""), out)
    return 0


def report(out: dict[str, Any], args: argparse.Namespace) -> str:
    seq, mixed = out["sequential_puts"], out["mixed"]
    alone, alone_after = out["search_alone"]["ms"], out["search_alone_after"]["ms"]
    search_p50 = (alone["p50"] + alone_after["p50"]) / 2
    search_p99 = (alone["p99"] + alone_after["p99"]) / 2
    writes = out["writes_alone"]
    comp = out["compaction"]
    five = sum(n for s, n in seq["statuses"].items() if s.startswith("5"))
    rows = [
        [f"{seq['puts']} sequential PUTs under ulimit -n {seq['fd_limit']}: 5xx", five, "0", five == 0],
        ["  descriptors per worker, most growth", seq["fd_growth_max"], "<= +64", seq["fd_growth_max"] <= 64],
        ["build encode stage, docs/s", out["encode_docs_per_s"], "", ""],
        [f"{args.writers} writers, 2 workers: writes/s", writes["per_s"], "", ""],
        ["  writes/s / encode docs/s", writes["per_s"] / out["encode_docs_per_s"], ">= 0.8",
         writes["per_s"] >= 0.8 * out["encode_docs_per_s"]],
        ["  write p50 / p99 ms", f"{writes['ms']['p50']:.0f} / {writes['ms']['p99']:.0f}", "p99 <= 2000",
         writes["ms"]["p99"] <= 2000],
        ["  write 5xx", writes["errors_5xx"], "0", writes["errors_5xx"] == 0],
        [f"{args.searchers} searchers alone: p50 / p99 ms (before, after)",
         f"{alone['p50']:.0f} / {alone['p99']:.0f}, {alone_after['p50']:.0f} / {alone_after['p99']:.0f}", "", ""],
        ["with the writers: search p50 / p99 ms", f"{mixed['searches']['ms']['p50']:.0f} / "
         f"{mixed['searches']['ms']['p99']:.0f}", "", ""],
        ["  search p50 ratio", mixed["searches"]["ms"]["p50"] / search_p50, "<= 2",
         mixed["searches"]["ms"]["p50"] <= 2 * search_p50],
        ["  search p99 ratio", mixed["searches"]["ms"]["p99"] / search_p99, "<= 3",
         mixed["searches"]["ms"]["p99"] <= 3 * search_p99],
        ["  writes/s, p99 ms with the searchers", f"{mixed['writes']['per_s']:.2f}, {mixed['writes']['ms']['p99']:.0f}",
         "", ""],
        [f"write p99 ms, without / during compaction ({comp['compactions']} rewrites, "
         f"median {comp['compaction_s']['p50']:.1f} s)", f"{comp['without']['ms']['p99']:.0f} / "
         f"{comp['during']['ms']['p99']:.0f}", "<= 2x",
         comp["during"]["ms"]["p99"] <= 2 * comp["without"]["ms"]["p99"]],
        ["  writes during compaction, 5xx", f"{comp['during']['writes']}, {comp['during']['errors_5xx']}", "0",
         comp["during"]["errors_5xx"] == 0],
    ]
    if "deletes" in out:
        d = out["deletes"]
        rows += [
            [f"single-id delete on {d['documents']:,} docs: p50 / p99 ms", f"{d['ms']['p50']:.1f} / {d['ms']['p99']:.1f}",
             "p50 <= 20", d["ms"]["p50"] <= 20],
            ["  bytes written per delete (write() calls): p50 / max", f"{d['write_bytes']['p50']:.0f} / "
             f"{d['max_write_bytes']}", "<= 65536", d["max_write_bytes"] <= 65536],
            ["  bytes of files a delete leaves: p50", f"{d['new_file_bytes']['p50']:.0f}", "", ""],
        ]
    return machine_line(out["machine"]) + "\n" + markdown_table(["measure", "value", "target", "met"], rows)


if __name__ == "__main__":
    os.chdir(ROOT)
    raise SystemExit(main())
