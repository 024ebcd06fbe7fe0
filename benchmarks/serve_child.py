"""One measured serving process: open an index with one reader, run queries, print one JSON line.

The memory-limit and footprint studies start this in a fresh process (inside a memory
cgroup for the former) so that each configuration starts from a known state:

    python -m benchmarks.serve_child --index IDX --queries IDX.queries.npz --reader posix --prefetch 1

Order of events: open the index (verify="none": hashing is not what is measured),
optionally read embeddings.bin once through the page cache (`--preload`, the steady
state of an mmap server that has run for a while: the cache holds as much of the table
as the memory limit allows), `--warmup` queries (not measured), then `--n` queries, one
call each with a batch of `--batch` queries, in a seeded shuffled order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import load_queries, rss_pss, take_queries


def preload(path: str, chunk: int = 8 << 20) -> float:
    """Read a file sequentially through the page cache; returns seconds."""
    started = time.perf_counter()
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - started


def mapped_rss(name: str) -> int:
    """Resident bytes of this process's mappings of files whose name starts with `name` (/proc/self/smaps)."""
    total, counting = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: range perms offset dev inode [path]
                counting = len(head) >= 6 and os.path.basename(head[5]).startswith(name)
            elif counting and head and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--index", required=True)
    p.add_argument("--queries", required=True)
    p.add_argument("--reader", required=True)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preload", type=int, default=0)
    p.add_argument("--params", default="{}", help="JSON search overrides (nprobe, prefetch_step, ...)")
    p.add_argument("--reader-options", default="{}", help="JSON Searcher.open(reader_options=...), e.g. the record cache")
    p.add_argument("--rows", default=None, help=".npy of query rows to run in order (warm-up first) instead of a shuffle")
    p.add_argument("--qps-calls", type=int, default=0,
                   help="after the single queries, this many calls of --qps-batch queries each (the stream goes on)")
    p.add_argument("--qps-batch", type=int, default=32)
    args = p.parse_args(argv)

    from espn import Searcher

    started = time.perf_counter()
    searcher = Searcher.open(args.index, reader=args.reader, verify="none", with_encoder=False,
                             reader_options=json.loads(args.reader_options))
    open_s = time.perf_counter() - started
    preload_s = preload(str(searcher.index.file("embeddings.bin"))) if args.preload else 0.0
    queries = load_queries(args.queries)
    rng = np.random.default_rng(args.seed)
    need = args.warmup + args.n * args.batch + args.qps_calls * args.qps_batch
    order = np.load(args.rows) if args.rows else rng.permutation(len(queries.cls))
    order = np.resize(order, need)  # repeat the order if there are fewer queries
    overrides = {**json.loads(args.params), "prefetch": bool(args.prefetch)}

    def run(rows: np.ndarray):
        t = time.perf_counter()
        results = searcher.search_embeddings(take_queries(queries, rows), **overrides)
        return (time.perf_counter() - t) * 1000, results

    for i in range(0, args.warmup, max(1, args.batch)):
        run(order[i : min(args.warmup, i + args.batch)])
    latencies, hit_rates, bytes_read, stages = [], [], [], []
    for i in range(args.n):
        rows = order[args.warmup + i * args.batch : args.warmup + (i + 1) * args.batch]
        ms, results = run(rows)
        latencies.append(ms)
        hit_rates += [r.stats.hit_rate for r in results]
        bytes_read.append(sum(r.stats.bytes_read for r in results))
        stages.append(results[0].stats.stage_ms)
    at = args.warmup + args.n * args.batch
    qps_ms = [run(order[at + i * args.qps_batch: at + (i + 1) * args.qps_batch])[0] for i in range(args.qps_calls)]
    mem = rss_pss()
    mem["table_rss"] = mapped_rss("embeddings.bin")  # mmap: the pages of the table its cgroup kept
    mem["cache_rss"] = mapped_rss("espn-rc-")  # the record cache's segment, as far as it is touched
    described = searcher.reader.describe()
    searcher.close()
    keys = sorted({k for s in stages for k in s})
    out = {
        "reader": args.reader, "prefetch": bool(args.prefetch), "batch": args.batch, "open_s": open_s,
        "preload_s": preload_s, "latencies_ms": latencies, "hit_rate": float(np.mean(hit_rates)),
        "bytes_read_per_call": float(np.mean(bytes_read)),
        "stage_ms_median": {k: float(np.median([s.get(k, 0.0) for s in stages])) for k in keys},
        "memory": mem, "pid": os.getpid(), "params": overrides,
        "qps": args.qps_batch * len(qps_ms) / (sum(qps_ms) / 1000) if qps_ms else None, "qps_call_ms": qps_ms,
        "record_cache": described.get("record_cache"),
    }
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
