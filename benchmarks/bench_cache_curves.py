"""Latency against the RAM an index may use: the posix reader with its record cache, without it,
and mmap, each in a memory cgroup of the same size (the ESPN paper's measure, as a curve).

    python -m benchmarks.bench_cache_curves --index .espn/pf/index --queries .espn/pf/queries.npz
    python -m benchmarks.bench_cache_curves --index .espn/tok100k/index --name cache_curves_tokens_100k

Per budget f (a fraction of embeddings.bin: 5%, 25%, 50%, 100%) every configuration runs in a
fresh process (`benchmarks.serve_child`) inside its own memory cgroup limited to base + f x
table (v1 `memory.limit_in_bytes` or v2 `memory.max`: anonymous memory, shared memory and page
cache alike), where base is the peak usage of a posix process without a limit (interpreter,
torch, FAISS, first stage). Configurations:

- posix: the posix reader, no cache (what it needs does not depend on f);
- posix+cache: the posix reader with a record cache of f x table (filled from the file at
  open, then by the stream);
- mmap: the mmap reader, embeddings.bin read once through the page cache first (the steady
  state of a long-running mmap server: the cgroup keeps what fits);
- memory: the whole table in RAM (only at 100%: below it cannot load).

The page cache is dropped before each process. Each round runs every (budget, configuration)
in a shuffled order on the same query stream (Zipf over topics, `bench_record_cache.stream`;
or uniform with `--stream uniform`): `--warmup` queries, then `--n` single queries (p50, p99),
then `--qps-calls` calls of 32 queries (batch-32 QPS). Tables give medians over rounds of each
round's figures and ratios taken round by round; the plot is p50 against budget. Without
cgroups (not root) it says so and runs without limits.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (MemoryCgroup, cgroup_unavailable_reason, drop_caches, load_queries, machine,
                               machine_line, markdown_table, median, percentiles, run_json_child, write_results)

BUDGETS = (0.05, 0.25, 0.5, 1.0)
CONFIGS = ("posix", "posix+cache", "mmap", "memory")


def child_argv(args: argparse.Namespace, config: str, fraction: float, rows: Path, table: int) -> list[str]:
    reader = {"posix+cache": "posix"}.get(config, config)
    options = {"record_cache_mb": fraction * table / 2**20, "record_cache_warm": True} if config == "posix+cache" else {}
    return [sys.executable, "-m", "benchmarks.serve_child", "--index", str(args.index), "--queries", str(args.queries),
            "--reader", reader, "--prefetch", "1", "--n", str(args.n), "--warmup", str(args.warmup),
            "--rows", str(rows), "--qps-calls", str(args.qps_calls), "--preload", "1" if config == "mmap" else "0",
            "--reader-options", json.dumps(options), "--params", args.params]


def run_one(args: argparse.Namespace, config: str, fraction: float, limit: int | None, rows: Path,
            table: int, tag: str) -> dict[str, Any]:
    """One configuration in a fresh process in its own cgroup (limit None: none)."""
    out: dict[str, Any] = {"config": config, "fraction": fraction, "limit": limit, "dropped_caches": drop_caches()}
    cg = MemoryCgroup(f"espn_curves_{os.getpid()}_{tag}", limit) if args.cgroups else None
    try:
        result, err = run_json_child(child_argv(args, config, fraction, rows, table),
                                     preexec=cg.enter if cg else None, timeout=args.timeout)
        if cg is not None:
            out.update(cgroup_peak=cg.peak(), oom_kills=cg.oom_kills())
        if result is None:
            out["error"] = err.strip()[-400:]
            return out
        out.update(result)
        out.update(percentiles(result["latencies_ms"]))
        return out
    finally:
        if cg is not None:
            cg.remove()


def summarise(runs: list[dict[str, Any]], fractions: list[float]) -> tuple[list[list[Any]], dict[str, Any]]:
    """Table rows (median over rounds per budget and configuration) and the per-round ratios."""
    rows, ratios = [], {}
    for f in fractions:
        for config in CONFIGS:
            mine = [r for r in runs if r["fraction"] == f and r["config"] == config]
            ok = [r for r in mine if "error" not in r]
            if not mine:
                continue
            if not ok:
                rows.append([f"{f:.0%}", config, "failed: " + mine[0]["error"][-80:], "", "", "", "", ""])
                continue
            cache = [r["record_cache"] for r in ok if r.get("record_cache")]
            rows.append([f"{f:.0%}", config, median([r["p50"] for r in ok]), median([r["p99"] for r in ok]),
                         median([r["qps"] for r in ok if r.get("qps")] or [float("nan")]),
                         median([r["hit_rate"] for r in ok]) if config != "memory" else "",
                         median([c["hit_rate"] for c in cache]) if cache else "",
                         max(int(r.get("cgroup_peak") or 0) for r in ok) / 2**20])
        ratios[f"{f:g}"] = round_ratios(runs, f)
    return rows, ratios


def round_ratios(runs: list[dict[str, Any]], f: float) -> dict[str, float]:
    """Medians over rounds of each round's ratios at budget f (posix+cache against the others)."""
    out: dict[str, list[float]] = {}
    for r in sorted({run["round"] for run in runs}):
        got = {run["config"]: run for run in runs if run["round"] == r and run["fraction"] == f and "error" not in run}
        cached = got.get("posix+cache")
        if cached is None:
            continue
        for other in ("posix", "mmap", "memory"):
            if other in got:
                out.setdefault(f"p50 cache/{other}", []).append(cached["p50"] / got[other]["p50"])
                if cached.get("qps") and got[other].get("qps"):
                    out.setdefault(f"qps cache/{other}", []).append(cached["qps"] / got[other]["qps"])
    return {key: median(values) for key, values in out.items()}


def plot(rows: list[list[Any]], fractions: list[float], title: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for config in CONFIGS:
        points = [(float(row[0].rstrip("%")), row[2]) for row in rows if row[1] == config and isinstance(row[2], float)]
        if points:
            axis.plot(*zip(*points), marker="o", label=config)
    axis.set_xlabel("RAM budget (% of the record table)")
    axis.set_ylabel("p50 latency (ms), single queries")
    axis.set_xticks([100 * f for f in fractions])
    axis.set_ylim(bottom=0)
    axis.set_title(title, fontsize=9)
    axis.legend()
    axis.grid(alpha=0.3)
    return figure


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_record_cache import stream, topics_of

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, required=True)
    p.add_argument("--queries", type=Path, default=None, help="query embeddings (.npz); default INDEX.queries.npz")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="fractions of embeddings.bin")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n", type=int, default=200, help="measured single queries per process")
    p.add_argument("--warmup", type=int, default=400)
    p.add_argument("--qps-calls", type=int, default=8, help="measured calls of 32 queries per process")
    p.add_argument("--stream", choices=("zipf", "uniform"), default="zipf")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--topics", type=int, default=32)
    p.add_argument("--params", default="{}", help="JSON search overrides")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--quick", action="store_true", help="1 round, 20 queries, budgets 25% and 100%")
    p.add_argument("--no-limit", action="store_true", help="run every configuration without a memory limit")
    p.add_argument("--name", default="cache_curves")
    args = p.parse_args(argv)
    args.queries = args.queries or args.index.with_name(args.index.name + ".queries.npz")
    fractions = [float(f) for f in args.budgets.split(",")]
    if args.quick:
        args.repeats, args.n, args.warmup, args.qps_calls = 1, 20, 20, 2
        fractions = [0.25, 1.0]
    reason = "--no-limit given" if args.no_limit else cgroup_unavailable_reason()
    args.cgroups = reason is None
    if reason:
        print(f"**cgroups unavailable: {reason}. Every configuration runs WITHOUT a memory limit; the budget "
              f"columns are labels only.**\n")
    table = (args.index / "embeddings.bin").stat().st_size
    queries = load_queries(args.queries)
    topics = topics_of(queries, args.topics)
    need = args.warmup + args.n + 32 * args.qps_calls
    work = Path(tempfile.mkdtemp(prefix="espn-curves-"))
    info = machine()
    base_rows = work / "base.npy"
    np.save(base_rows, stream(args.stream, len(queries.cls), need, topics, args.zipf, seed=999))
    base_run = run_one(args, "posix", 1.0, None, base_rows, table, "base")
    base = int(base_run.get("cgroup_peak") or base_run.get("memory", {}).get("peak_rss", 0)) + (32 << 20)
    print(f"embeddings.bin {table / 2**20:.0f} MiB; base {base / 2**20:.0f} MiB (peak of posix without a limit, "
          f"+32 MiB)", file=sys.stderr)
    runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        rows_path = work / f"round{r}.npy"
        np.save(rows_path, stream(args.stream, len(queries.cls), need, topics, args.zipf, seed=r))
        plan = [(f, c) for f in fractions for c in CONFIGS if c != "memory" or f >= 1.0]
        random.Random(r).shuffle(plan)
        for f, config in plan:
            limit = base + int(f * table)
            run = run_one(args, config, f, limit, rows_path, table, f"{r}_{config.replace('+', '')}_{f:g}")
            run["round"] = r
            runs.append(run)
            print(f"round {r} {f:.0%} {config}: " + (run.get("error", "")[-200:] or
                  f"p50 {run['p50']:.2f} ms, qps {run.get('qps') or 0:.1f}, hit rate {run['hit_rate']:.3f}"),
                  file=sys.stderr)
    rows, ratios = summarise(runs, fractions)
    headers = ["budget (of table)", "configuration", "p50 ms", "p99 ms", "batch-32 QPS", "prefetch hit rate",
               "cache hit rate", "cgroup peak MiB"]
    table_md = markdown_table(headers, rows)
    ratio_md = markdown_table(["budget", *sorted({k for v in ratios.values() for k in v})],
                              [[f"{float(f):.0%}", *[ratios[f].get(k, "") for k in sorted({k for v in ratios.values()
                                                                                         for k in v})]]
                               for f in ratios])
    load = os.getloadavg()
    print(f"Index {args.index}: {table / 2**20:.0f} MiB of records; limit base {base / 2**20:.0f} MiB + budget; "
          f"{args.stream} stream, {args.warmup} warm-up, {args.n} single queries and {args.qps_calls} x 32 per process; "
          f"{args.repeats} rounds; load average {load[0]:.2f} at the end. Machine: {machine_line(info)}\n\n"
          f"{table_md}\n\n{ratio_md}")
    write_results(args.name, {"machine": info, "index": str(args.index), "table_bytes": table, "base": base,
                              "runs": runs, "table_md": table_md, "ratios": ratios, "cgroups": args.cgroups,
                              "stream": args.stream},
                  figure=plot(rows, fractions, f"{args.index.name}: {args.stream} stream, memory cgroup = base + budget"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
