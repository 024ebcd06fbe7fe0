"""Memory limits (the paper's Table 4): query latency per reader under cgroup memory limits.

    python -m benchmarks.bench_memory --index /tmp/espn-synth-2m            # full (as root)
    python -m benchmarks.bench_memory --index /tmp/espn-synth --quick

Every configuration runs in a fresh process (`benchmarks.serve_child`) inside a memory
cgroup (v1 `memory.limit_in_bytes` or v2 `memory.max`: the limit covers anonymous
memory *and* page cache, as in the paper). The limit is

    base + fraction × size of embeddings.bin,   fraction in 100%, 50%, 25%, 10%

where `base` is the peak cgroup usage of a posix-reader process without a limit (the
interpreter, torch, FAISS index, query buffers: what every reader needs besides the
table). Readers: memory (whole table in RAM; only at 100%: below it cannot load),
mmap (MADV_RANDOM), posix without prefetch, posix with prefetch.

Cold state, made explicit: before each configuration the page cache is dropped
(`echo 3 > /proc/sys/vm/drop_caches`); the mmap process then reads embeddings.bin once
through the cache inside its cgroup (the steady state of a long-running mmap server: the
cache holds what the limit allows) and every process runs `--warmup` unmeasured queries.
Configurations run in a shuffled order in each of `--repeats` rounds; tables report the
median over rounds of each round's mean, p50 and p99 (batch of 1 query per call).
Without cgroups (not root) the script says so and runs every reader without a limit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (MemoryCgroup, cgroup_unavailable_reason, drop_caches, machine, machine_line,
                               markdown_table, median, percentiles, run_json_child, write_results)

FRACTIONS = (1.0, 0.5, 0.25, 0.1)
CONFIGS = (("memory", 0), ("memory", 1), ("mmap", 0), ("posix", 0), ("posix", 1))


def label(reader: str, prefetch: int) -> str:
    if reader == "mmap":
        return "mmap"
    return f"{reader} {'+ prefetch' if prefetch else 'no prefetch'}"


def run_config(args, reader: str, prefetch: int, limit: int | None, tag: str, seed: int) -> dict:
    argv = [sys.executable, "-m", "benchmarks.serve_child", "--index", str(args.index), "--queries",
            str(args.queries), "--reader", reader, "--prefetch", str(prefetch), "--n", str(args.queries_n),
            "--warmup", str(args.warmup), "--seed", str(seed), "--preload", "1" if reader == "mmap" else "0",
            "--params", args.params]
    dropped = drop_caches()
    cg = None
    if args.cgroups:
        cg = MemoryCgroup(f"espn_bench_{os.getpid()}_{tag}", limit)
    try:
        result, err = run_json_child(argv, preexec=cg.enter if cg else None, timeout=args.timeout)
        out = {"reader": reader, "prefetch": prefetch, "limit": limit, "dropped_caches": dropped}
        if cg is not None:
            out["cgroup_peak"] = cg.peak()
            out["oom_kills"] = cg.oom_kills()
        if result is None:
            out["error"] = err.strip()[-300:]
        else:
            out.update(result)
            out.update(percentiles(result["latencies_ms"]))
        return out
    finally:
        if cg is not None:
            cg.remove()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, required=True)
    p.add_argument("--queries", type=Path, default=None, help="default: INDEX.queries.npz")
    p.add_argument("--quick", action="store_true", help="1 round, 20 queries, 2 limits")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n", dest="queries_n", type=int, default=300, help="measured queries per configuration")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--fractions", default=None, help="comma list of table fractions (default 1,0.5,0.25,0.1)")
    p.add_argument("--params", default="{}", help="JSON search overrides, e.g. '{\"nprobe\": 64}'")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--name", default="memory_limits")
    p.add_argument("--configs", default=None,
                   help="comma list of READER:PREFETCH (default memory:0,memory:1,mmap:0,posix:0,posix:1; "
                        "bench_gpu adds kvikio:0,kvikio:1)")
    p.add_argument("--no-limit", action="store_true", help="run every configuration without a memory limit")
    args = p.parse_args(argv)
    configs = CONFIGS
    if args.configs:
        configs = tuple((r, int(pf)) for r, pf in (c.split(":") for c in args.configs.split(",")))
    args.queries = args.queries or args.index.with_name(args.index.name + ".queries.npz")
    fractions = [float(f) for f in args.fractions.split(",")] if args.fractions else list(FRACTIONS)
    if args.quick:
        args.repeats, args.queries_n, args.warmup = 1, 20, 5
        fractions = fractions if args.fractions else [1.0, 0.1]
    reason = "--no-limit given" if args.no_limit else cgroup_unavailable_reason()
    args.cgroups = reason is None
    if reason:
        print(f"**cgroups unavailable: {reason}. Every reader runs WITHOUT a memory limit; the "
              f"'limit' columns are labels only.**\n")
    table_bytes = (args.index / "embeddings.bin").stat().st_size
    info = machine()

    # Base: what a posix server needs besides the table (its peak cgroup usage, no limit).
    base_run = run_config(args, "posix", 1, None, "base", seed=999)
    base = int(base_run.get("cgroup_peak") or base_run.get("memory", {}).get("peak_rss", 0)) + (32 << 20)
    limits = {f: base + int(f * table_bytes) for f in fractions}
    print(f"embeddings.bin {table_bytes / 2**30:.2f} GiB; base {base / 2**20:.0f} MiB; limits "
          + ", ".join(f"{int(f * 100)}%: {limits[f] / 2**30:.2f} GiB" for f in fractions), file=sys.stderr)

    runs: list[dict] = []
    for r in range(args.repeats):
        plan = [(f, reader, pf) for f in fractions for reader, pf in configs if reader != "memory" or f >= 1.0]
        random.Random(r).shuffle(plan)
        for i, (f, reader, pf) in enumerate(plan):
            res = run_config(args, reader, pf, limits[f] if args.cgroups else None, f"r{r}_{i}", seed=r)
            res.update(fraction=f, round=r)
            runs.append(res)
            status = res.get("error") or f"mean {res['mean']:.1f} ms p99 {res['p99']:.1f} hit {res['hit_rate']:.3f}"
            print(f"round {r} {int(f * 100)}% {label(reader, pf)}: {status}", file=sys.stderr)

    def agg(f: float, reader: str, pf: int, key: str) -> float:
        return median([x[key] for x in runs if x["fraction"] == f and x["reader"] == reader
                       and x["prefetch"] == pf and key in x])

    memory_mean = agg(1.0, "memory", 0, "mean") if 1.0 in fractions and ("memory", 0) in configs else float("nan")
    memory_pf_mean = agg(1.0, "memory", 1, "mean") if 1.0 in fractions and ("memory", 1) in configs else float("nan")
    rows: list[list[Any]] = []
    summary: list[dict[str, Any]] = []
    for f in fractions:
        for reader, pf in configs:
            if reader == "memory" and f < 1.0:
                if pf:
                    continue
                rows.append([f"{int(f * 100)}%", label(reader, pf), "does not fit", "", "", "", ""])
                continue
            mean, p50, p99 = (agg(f, reader, pf, k) for k in ("mean", "p50", "p99"))
            hit = agg(f, reader, pf, "hit_rate") if pf else float("nan")
            rows.append([f"{int(f * 100)}%", label(reader, pf), mean, p50, p99, mean / memory_mean, hit])
    # "memory" is the paper's in-memory baseline. "memory + prefetch" asks for prefetching from
    # RAM: the memory reader's reads are CPU work, so the cost model takes no waves there.
        pf_mean, mmap_mean = agg(f, "posix", 1, "mean"), agg(f, "mmap", 0, "mean")
        summary.append({"fraction": f, "limit_bytes": limits[f], "prefetch_vs_memory": pf_mean / memory_mean,
                        "prefetch_vs_memory_p50": agg(f, "posix", 1, "p50") / agg(1.0, "memory", 0, "p50"),
                        "prefetch_vs_no_prefetch": pf_mean / agg(f, "posix", 0, "mean"),
                        "prefetch_vs_no_prefetch_p50": agg(f, "posix", 1, "p50") / agg(f, "posix", 0, "p50"),
                        "prefetch_vs_memory_prefetch": pf_mean / memory_pf_mean, "mmap_vs_prefetch": mmap_mean / pf_mean})
        if ("kvikio", 1) in configs:  # the GPU run (bench_gpu)
            kv_mean = agg(f, "kvikio", 1, "mean")
            summary[-1].update(kvikio_prefetch_vs_memory=kv_mean / memory_mean,
                               kvikio_prefetch_vs_memory_prefetch=kv_mean / memory_pf_mean,
                               kvikio_prefetch_vs_posix_prefetch=kv_mean / pf_mean)
    table = markdown_table(["limit (of table)", "reader", "mean ms", "p50 ms", "p99 ms", "× memory", "hit rate"], rows)
    table2 = markdown_table(["limit", "posix+prefetch / memory, mean (target <= 1.05, floor 1.10)", "same, p50",
                             "posix+prefetch / posix no prefetch, mean (target <= 1)", "same, p50",
                             "mmap / posix+prefetch, mean (target >= 1.9 at 10%)"],
                            [[f"{int(s['fraction'] * 100)}%", s["prefetch_vs_memory"], s["prefetch_vs_memory_p50"],
                              s["prefetch_vs_no_prefetch"], s["prefetch_vs_no_prefetch_p50"], s["mmap_vs_prefetch"]]
                             for s in summary])
    if ("kvikio", 1) in configs:
        table2 += "\n\n" + markdown_table(
            ["limit", "kvikio+prefetch / memory", "kvikio+prefetch / memory+prefetch", "kvikio+prefetch / posix+prefetch"],
            [[f"{int(s['fraction'] * 100)}%", s["kvikio_prefetch_vs_memory"], s["kvikio_prefetch_vs_memory_prefetch"],
              s["kvikio_prefetch_vs_posix_prefetch"]] for s in summary])
    header = (f"Index {args.index} ({table_bytes / 2**30:.2f} GiB embeddings.bin); {args.repeats} round(s) × "
              f"{args.queries_n} queries (+{args.warmup} warm-up), batch 1; "
              f"{'cgroup memory limits' if args.cgroups else f'NO memory limit ({reason})'}; "
              f"base {base / 2**20:.0f} MiB. Machine: {machine_line(info)}")
    print(header + "\n\n" + table + "\n\n" + table2)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for reader, pf in configs:
        xs = [f for f in fractions if reader != "memory" or f >= 1.0]
        ax.plot([100 * f for f in xs], [agg(f, reader, pf, "mean") for f in xs], "o-", label=label(reader, pf))
    ax.set_xlabel("memory limit (% of embedding table)")
    ax.set_ylabel("mean latency (ms)")
    ax.set_yscale("log")
    ax.invert_xaxis()
    ax.legend()
    ax.set_title("End-to-end latency under memory limits")
    write_results(args.name, {"machine": info, "index": str(args.index), "table_bytes": table_bytes, "base_bytes": base,
                              "cgroups": args.cgroups, "cgroup_reason": reason, "limits": limits, "runs": runs,
                              "summary": summary, "base_run": base_run, "table_md": table, "summary_md": table2}, fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
