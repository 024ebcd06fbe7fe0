"""HTTP serving benchmark: memory of N workers sharing one index, and latency under load.

For each worker count it starts `espn serve INDEX --workers N` on a free loopback port,
drives a bounded closed loop of POST /v1/search requests (SciFact test queries) at each
concurrency, then measures the proportional set size (PSS) of every worker process:
PSS = private pages + each shared page / number of processes sharing it, read per
mapping from /proc/PID/smaps via psutil `memory_maps()`. Summed over the workers it is
what they really cost together; the script breaks it down by what the pages hold
(index files, encoder weights, shared libraries, anonymous heap).

    .venv/bin/python benchmarks/bench_server.py                     # builds the SciFact index if absent
    .venv/bin/python benchmarks/bench_server.py --index PATH --workers 1 4 --concurrency 1 8 32
    .venv/bin/python benchmarks/bench_server.py --index PATH --quick    # 1 worker, 20 requests per level
    .venv/bin/python benchmarks/bench_server.py --index PATH --versus-library --reader posix --rounds 7

`--versus-library` measures what HTTP adds instead: one worker and, in this process, a
Searcher over the same index with the same reader and torch threads; alternating rounds of
one client (sequential POST /v1/search on a keep-alive connection) and of the library's
`search([query])`, then alternating rounds of 1 and 8 concurrent clients (a lean raw-socket
client, so the load generator takes little of the CPU it shares with the server).

Not a test: it prints tables for the docs (docs/benchmarks/http-service.md). The load generator runs on the same
machine, so on a small box it competes with the server for CPU; the numbers say so.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCIFACT = ROOT.parent / "shared" / "data" / "scifact"
#: Readiness polls and /metrics reads share one client: httpx.get() builds a Client, and loads
#: the CA bundle, per call (56 ms of CPU here, taken from the server being measured).
_HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_index(index: Path, corpus: Path) -> Path:
    if (index / "manifest.json").is_file():
        return index
    print(f"building {index} from {corpus} (once) ...", file=sys.stderr, flush=True)
    subprocess.run([str(BIN / "espn"), "index", str(corpus), "--out", str(index), "--no-progress"], check=True)
    return index


def load_queries(path: Path, qrels: Optional[Path]) -> list[str]:
    wanted: Optional[set[str]] = None
    if qrels is not None and qrels.is_file():
        wanted = {line.split("\t")[0] for line in qrels.read_text().splitlines()[1:] if line.strip()}
    queries = []
    with open(path) as lines:
        for line in lines:
            row = json.loads(line)
            if wanted is None or row["_id"] in wanted:
                queries.append(row["text"])
    return queries


@contextlib.contextmanager
def serve(index: Path, workers: int, extra: list[str], log_path: Path) -> Iterator[tuple[str, psutil.Process]]:
    """`espn serve` in its own session; yields (base URL, supervisor process); always stops it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ESPN_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    command = [str(BIN / "espn"), "serve", str(index), "--port", str(port), "--workers", str(workers),
               "--log-level", "info", *extra]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, process, workers, log_path)
        yield base, psutil.Process(process.pid)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # stray workers of this run's session only


def wait_ready(base: str, process: subprocess.Popen, workers: int, log_path: Path, timeout: float = 600) -> None:
    """Every worker has opened and warmed the index: each logs one `ready` line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"espn serve exited {process.returncode}:\n{log_path.read_text()[-4000:]}")
        ready = sum(1 for line in log_path.read_text(errors="replace").splitlines()
                    if line.startswith("{") and json.loads(line).get("msg") == "ready")
        if ready >= workers:
            with contextlib.suppress(httpx.HTTPError):
                if _HTTP.get(f"{base}/readyz", timeout=5).status_code == 200:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"not ready after {timeout} s:\n{log_path.read_text()[-4000:]}")


def worker_processes(supervisor: psutil.Process) -> list[psutil.Process]:
    """The processes that serve requests: the uvicorn workers, or the server itself with one worker."""
    children = [child for child in supervisor.children(recursive=True)
                if "resource_tracker" not in " ".join(child.cmdline())]
    return children or [supervisor]


def classify(path: str, index: Path) -> str:
    if path.startswith(str(index)):
        return "index files"
    if path.endswith(".safetensors") or path.endswith(".bin") and "model" in path:
        return "encoder weights (file)"
    if ".so" in os.path.basename(path):
        return "shared libraries"
    if path in ("", "[heap]", "[anon]") or path.startswith("[anon") or path.startswith("/dev/shm") \
            or path.startswith("/memfd"):
        return "anonymous (heap, tensors)"
    return "other files"


def pss_breakdown(processes: list[psutil.Process], index: Path) -> dict[str, dict[str, int]]:
    """Per process kind: PSS and USS summed over the processes, by mapping category (bytes)."""
    totals: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
    for process in processes:
        for mapping in process.memory_maps(grouped=True):
            kind = classify(mapping.path, index)
            uss = mapping.private_clean + mapping.private_dirty
            totals["pss"][kind] += mapping.pss
            totals["uss"][kind] += uss
            totals["rss"][kind] += mapping.rss
    return totals


async def load(base: str, queries: list[str], concurrency: int, requests: int, k: int) -> dict[str, float]:
    """A closed loop: `concurrency` clients, each sends its next query when the last one answered."""
    latencies: list[float] = []
    errors = 0
    counter = iter(range(requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=120.0, limits=limits) as client:

        async def client_loop() -> None:
            nonlocal errors
            for i in counter:
                body = {"query": queries[i % len(queries)], "k": k}
                started = time.perf_counter()
                response = await client.post("/v1/search", json=body)
                latencies.append(time.perf_counter() - started)
                if response.status_code != 200:
                    errors += 1

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    latencies.sort()
    return {
        "qps": len(latencies) / wall,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "mean_ms": 1000 * statistics.fmean(latencies),
        "errors": errors,
        "requests": len(latencies),
    }


class RawClient:
    """One keep-alive HTTP/1.1 connection that POSTs pre-encoded bodies and reads the answer:
    the least client work per request, so what is timed is the server."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None

    async def post(self, path: str, body: bytes) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), len(body), body))
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))  # type: ignore[union-attr]
        await self.reader.readexactly(length)
        return status

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def raw_load(base: str, bodies: list[bytes], concurrency: int, requests: int) -> dict[str, float]:
    """A closed loop of `concurrency` RawClients over `requests` requests: QPS and p50."""
    host, port = base.removeprefix("http://").split(":")
    latencies: list[float] = []
    counter = iter(range(requests))

    async def client_loop() -> None:
        client = RawClient(host, int(port))
        try:
            for i in counter:
                started = time.perf_counter()
                if await client.post("/v1/search", bodies[i % len(bodies)]) != 200:
                    raise RuntimeError("a search failed")
                latencies.append(time.perf_counter() - started)
        finally:
            await client.close()

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    return {"qps": len(latencies) / wall, "p50_ms": 1000 * statistics.median(latencies)}


def versus_library(index: Path, queries: list[str], args: argparse.Namespace) -> int:
    """HTTP p50 / library p50 at one client, and QPS at 8 clients / 1 client, in alternating rounds."""
    # As `espn` and `espn serve` do before torch loads OpenMP: idle threads must not spin (on a
    # shared machine a spinning pool makes the library side, not HTTP, the slow one).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from espn import Searcher

    threads = args.torch_threads or max(1, len(os.sched_getaffinity(0)))
    torch.set_num_threads(threads)
    extra = ["--reader", args.reader, "--torch-threads", str(threads), *args.serve_arg]
    bodies = [json.dumps({"query": q, "k": args.k}).encode() for q in queries]
    n = args.requests
    http_p50, lib_p50, qps1, qps8, lib_batch8 = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp, \
            serve(index, 1, extra, Path(tmp) / "serve.log") as (base, _), \
            Searcher.open(index, reader=args.reader) as searcher:
        asyncio.run(raw_load(base, bodies, 8, 64))  # warm both sides
        for q in queries[:32]:
            searcher.search([q], k=args.k)
        for round_ in range(args.rounds):
            order = [0, 1] if round_ % 2 == 0 else [1, 0]
            for side in order:
                offset = (round_ * n) % len(queries)
                if side == 0:
                    http_p50.append(asyncio.run(raw_load(base, bodies[offset:] + bodies[:offset], 1, n))["p50_ms"])
                else:
                    times = []
                    for i in range(n):
                        started = time.perf_counter()
                        searcher.search([queries[(offset + i) % len(queries)]], k=args.k)
                        times.append(time.perf_counter() - started)
                    lib_p50.append(1000 * statistics.median(times))
                    # The ceiling of 8 clients over 1: the library's own QPS at batch 8 over batch 1.
                    eight = [queries[(offset + i) % len(queries)] for i in range(n - n % 8)]
                    started = time.perf_counter()
                    for i in range(0, len(eight), 8):
                        searcher.search(eight[i:i + 8], k=args.k)
                    lib_batch8.append(len(eight) / (time.perf_counter() - started) / (n / sum(times)))
            for concurrency in ([1, 8] if round_ % 2 == 0 else [8, 1]):
                qps = asyncio.run(raw_load(base, bodies, concurrency, 4 * n if concurrency == 8 else n))["qps"]
                (qps1 if concurrency == 1 else qps8).append(qps)
    med = statistics.median
    print(f"index {index}, reader {args.reader}, k={args.k}, torch threads {threads}, {args.rounds} rounds of "
          f"{n} queries, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("| measure | per round | median |\n|---|---|---|")
    for name, values in (("HTTP p50 ms (1 client)", http_p50), ("library p50 ms", lib_p50),
                         ("QPS, 1 client", qps1), ("QPS, 8 clients", qps8)):
        print(f"| {name} | {', '.join(f'{v:.2f}' for v in values)} | {med(values):.2f} |")
    ratios = [h / lib for h, lib in zip(http_p50, lib_p50)]
    print(f"| HTTP p50 / library p50 | {', '.join(f'{r:.3f}' for r in ratios)} | {med(ratios):.3f} |")
    print(f"| HTTP p50 - library p50 ms | {', '.join(f'{h - lib:.2f}' for h, lib in zip(http_p50, lib_p50))} | "
          f"{med([h - lib for h, lib in zip(http_p50, lib_p50)]):.2f} |")
    print(f"| QPS 8 clients / 1 client | {', '.join(f'{a / b:.2f}' for a, b in zip(qps8, qps1))} | "
          f"{med([a / b for a, b in zip(qps8, qps1)]):.2f} |")
    print(f"| library QPS, batch 8 / batch 1 (the ceiling of the line above) | "
          f"{', '.join(f'{r:.2f}' for r in lib_batch8)} | {med(lib_batch8):.2f} |")
    return 0


def metric_sum(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})?\s+(\S+)$", text, re.M))


def mib(value: float) -> str:
    return f"{value / 2**20:,.0f}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", type=Path, default=ROOT / ".espn" / "scifact-index")
    parser.add_argument("--corpus", type=Path, default=SCIFACT / "corpus.jsonl.gz", help="to build --index if absent")
    parser.add_argument("--queries", type=Path, default=SCIFACT / "queries.jsonl")
    parser.add_argument("--qrels", type=Path, default=SCIFACT / "qrels" / "test.tsv", help="keep these query ids")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=300, help="requests per concurrency level (bounded loop)")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--serve-arg", action="append", default=[], help="extra flag for espn serve (repeatable)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="1 worker, 1 and 4 clients, 20 requests each "
                                                             "(the CI smoke test)")
    parser.add_argument("--versus-library", action="store_true",
                        help="what HTTP adds over the library (1 worker, alternating rounds; see the module doc)")
    parser.add_argument("--reader", default="posix", help="--versus-library: the reader of both sides")
    parser.add_argument("--rounds", type=int, default=7, help="--versus-library: alternating rounds")
    parser.add_argument("--torch-threads", type=int, help="--versus-library: both sides (default: the CPUs)")
    args = parser.parse_args(argv)
    if args.versus_library:
        return versus_library(ensure_index(args.index.resolve(), args.corpus), load_queries(args.queries, args.qrels),
                              args)
    if args.quick:
        args.workers, args.concurrency, args.requests = [1], [1, 4], 20

    index = ensure_index(args.index.resolve(), args.corpus)
    queries = load_queries(args.queries, args.qrels)
    print(f"index {index} ({sum(f.stat().st_size for f in index.rglob('*') if f.is_file()) / 2**20:.0f} MiB on disk), "
          f"{len(queries)} queries, {os.cpu_count()} CPUs, load generator on the same machine", flush=True)

    results: dict[str, Any] = {"memory": {}, "load": {}}
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        for workers in args.workers:
            log_path = Path(tmp) / f"serve-{workers}.log"
            with serve(index, workers, args.serve_arg, log_path) as (base, supervisor):
                # Warm every worker's code paths before timing (connections spread over workers).
                asyncio.run(load(base, queries, max(args.concurrency), 4 * max(args.concurrency), args.k))
                for concurrency in args.concurrency:
                    before = _HTTP.get(f"{base}/metrics").text
                    stats = asyncio.run(load(base, queries, concurrency, args.requests, args.k))
                    after = _HTTP.get(f"{base}/metrics").text
                    batches = metric_sum(after, "espn_search_batch_size_count") - metric_sum(before, "espn_search_batch_size_count")
                    queried = metric_sum(after, "espn_search_batch_size_sum") - metric_sum(before, "espn_search_batch_size_sum")
                    rate_n = metric_sum(after, "espn_prefetch_hit_rate_count") - metric_sum(before, "espn_prefetch_hit_rate_count")
                    rate_s = metric_sum(after, "espn_prefetch_hit_rate_sum") - metric_sum(before, "espn_prefetch_hit_rate_sum")
                    stats["mean_batch"] = queried / batches if batches else float("nan")
                    stats["hit_rate"] = rate_s / rate_n if rate_n else float("nan")
                    results["load"][f"{workers}x{concurrency}"] = {"workers": workers, "concurrency": concurrency, **stats}
                    print(f"workers={workers} concurrency={concurrency}: {stats['qps']:.1f} QPS, "
                          f"p50 {stats['p50_ms']:.1f} ms, p99 {stats['p99_ms']:.1f} ms, "
                          f"mean batch {stats['mean_batch']:.2f}, errors {stats['errors']}", flush=True)
                serving = worker_processes(supervisor)
                breakdown = pss_breakdown(serving, index)
                extra = [p for p in [supervisor, *supervisor.children(recursive=True)] if p not in serving]
                helper_pss = sum(sum(pss_breakdown([p], index)["pss"].values()) for p in extra)
                results["memory"][workers] = {
                    "processes": len(serving),
                    "pss_total": sum(breakdown["pss"].values()),
                    "uss_total": sum(breakdown["uss"].values()),
                    "rss_total": sum(breakdown["rss"].values()),
                    "pss_by_kind": dict(breakdown["pss"]),
                    "uss_by_kind": dict(breakdown["uss"]),
                    "supervisor_and_helpers_pss": helper_pss,
                }

    print("\n## Memory of the serving processes (after load)\n")
    kinds = sorted({kind for m in results["memory"].values() for kind in m["pss_by_kind"]})
    header = "| workers | total PSS MiB | total USS MiB | sum of RSS MiB | " + " | ".join(f"PSS {k}" for k in kinds) + \
        " | supervisor+helpers PSS MiB |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for workers, m in results["memory"].items():
        cells = " | ".join(mib(m["pss_by_kind"].get(kind, 0)) for kind in kinds)
        print(f"| {workers} | {mib(m['pss_total'])} | {mib(m['uss_total'])} | {mib(m['rss_total'])} | {cells} | "
              f"{mib(m['supervisor_and_helpers_pss'])} |")
    if len(results["memory"]) >= 2:
        counts = sorted(results["memory"])
        low, high = results["memory"][counts[0]], results["memory"][counts[-1]]
        ratio = high["pss_total"] / low["pss_total"]
        everything = (high["pss_total"] + high["supervisor_and_helpers_pss"]) / \
            (low["pss_total"] + low["supervisor_and_helpers_pss"])
        print(f"\n{counts[-1]} workers / {counts[0]} worker, total PSS of the workers: {ratio:.2f}x "
              f"({'within' if ratio <= 1.3 else 'ABOVE'} the 1.3x target); with the supervisor: {everything:.2f}x; "
              f"private (USS) per worker: {mib(high['uss_total'] / high['processes'])} MiB")
        results["pss_ratio"] = ratio
        results["pss_ratio_all_processes"] = everything

    print("\n## Latency under load (POST /v1/search, k=%d, closed loop)\n" % args.k)
    print("| workers | clients | QPS | p50 ms | p99 ms | mean batch | prefetch hit rate | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for row in results["load"].values():
        print(f"| {row['workers']} | {row['concurrency']} | {row['qps']:.1f} | {row['p50_ms']:.1f} | "
              f"{row['p99_ms']:.1f} | {row['mean_batch']:.2f} | {row['hit_rate']:.3f} | {row['errors']} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
