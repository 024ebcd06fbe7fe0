"""Latency against the RAM an index may use: the posix reader with its record cache, without it,
and mmap, each in a memory cgroup of the same size (the ESPN paper's measure, as a curve).

    python -m benchmarks.bench_cache_curves --index .espn/pf/index --queries .espn/pf/queries.npz
    python -m benchmarks.bench_cache_curves --index .espn/tok100k/index --name cache_curves_tokens_100k

Per budget f (a fraction of embeddings.bin: 5%, 25%, 50%, 100%) every configuration runs in
its own process (`benchmarks.stream_child`) inside its own memory cgroup limited to base + f x
table (v1 `memory.limit_in_bytes` or v2 `memory.max`: anonymous memory, shared memory and page
cache alike), where base is the peak usage of a posix process without a limit (interpreter,
torch, FAISS, first stage, read buffers) plus 32 MiB. Configurations:

- posix: the posix reader, no cache (what it needs does not depend on f);
- posix+cache: the posix reader with a record cache of f x table (filled from the file at
  open, then by the stream);
- mmap: the mmap reader, embeddings.bin read once through the page cache first (the steady
  state of a long-running mmap server: the cgroup keeps what fits);
- memory: the whole table in RAM (only at 100%: below it cannot load).

One run per budget and round: the page cache is dropped, the index's small files are read by
this process and a posix child outside any limit searches once (so the small files and the
library files are charged to this process's cgroup, not to whichever child maps them first), the
children start, and then they take turns query by query (the order rotating), so every
configuration sees the same load on a shared machine: `--warmup` queries of the stream (Zipf over topics, `bench_record_cache.stream`;
or uniform with `--stream uniform`), `--n` single queries (p50, p99), then `--qps-calls` calls
of 32 queries (batch-32 QPS). Tables give medians over rounds; ratios are taken round by round.
The plot is p50 against budget. Without cgroups (not root) it says so and runs without limits.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (OMP_ENV, ROOT, MemoryCgroup, cgroup_unavailable_reason, drop_caches, load_queries,
                               machine, machine_line, markdown_table, median, percentiles, write_results)

BUDGETS = (0.05, 0.25, 0.5, 1.0)
CONFIGS = ("posix", "posix+cache", "mmap", "memory")


class Child:
    """One configuration's stream_child, in its own cgroup (None: no limit)."""

    def __init__(self, args: argparse.Namespace, config: str, fraction: float, table: int, limit: int | None,
                 tag: str, log: Path) -> None:
        self.config, self.fraction, self.limit = config, fraction, limit
        self.cgroup = MemoryCgroup(f"espn_curves_{os.getpid()}_{tag}", limit) if args.cgroups else None
        reader = {"posix+cache": "posix"}.get(config, config)
        options = {"record_cache_mb": fraction * table / 2**20, "record_cache_warm": True} \
            if config == "posix+cache" else {}
        argv = [sys.executable, "-m", "benchmarks.stream_child", "--index", str(args.index), "--queries",
                str(args.queries), "--reader", reader, "--reader-options", json.dumps(options), "--params", args.params,
                *(["--preload"] if config == "mmap" else [])]
        self._log = open(log, "ab")
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                        text=True, cwd=ROOT, env={**os.environ, **OMP_ENV},
                                        preexec_fn=self.cgroup.enter if self.cgroup else None)
        try:
            self.ready = self._answer()
        except BaseException:  # it did not start: its cgroup goes with it
            self.close()
            raise

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise RuntimeError(f"{self.config} at {self.fraction:.0%} exited {code}"
                               f"{' (OOM-killed)' if self.cgroup and self.cgroup.oom_kills() else ''}")
        return json.loads(line)

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> dict[str, Any]:
        """Stop it; its memory, reader description and its cgroup's peak."""
        out: dict[str, Any] = {}
        try:
            if self.process.poll() is None:
                out = self.ask({"stop": True})
            self.process.wait(60)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
            out["error"] = str(error)
            self.process.kill()
            self.process.wait(10)
        finally:
            self._log.close()
            if self.cgroup is not None:
                out.update(cgroup_peak=self.cgroup.peak(), oom_kills=self.cgroup.oom_kills())
                self.cgroup.remove()
        return out


def touch_small_files(index: Path) -> None:
    """Read every file of the index but the table and the passages, so the page cache holds them
    charged to this process, not to whichever child maps them first."""
    for path in index.rglob("*"):
        if path.is_file() and path.name not in ("embeddings.bin", "docs.jsonl"):
            path.read_bytes()


def prime(args: argparse.Namespace) -> None:
    """Start a posix stream_child in this process's cgroup, search once and stop it, so the page
    cache holds the interpreter's, torch's and FAISS's library files (and the index's small files)
    charged here: otherwise whichever child starts first after a page-cache drop pays for them in
    its cgroup (about 140 MB on SciFact's index), and the mmap child, started last, never does."""
    argv = [sys.executable, "-m", "benchmarks.stream_child", "--index", str(args.index), "--queries",
            str(args.queries), "--reader", "posix", "--params", args.params]
    requests = json.dumps({"rows": [0]}) + "\n" + json.dumps({"stop": True}) + "\n"
    subprocess.run(argv, input=requests, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                   cwd=ROOT, env={**os.environ, **OMP_ENV})


def run_budget(args: argparse.Namespace, fraction: float, base: int, table: int, rows: np.ndarray,
               configs: list[str], tag: str, log: Path) -> list[dict[str, Any]]:
    """Every configuration at one budget, query by query in turn; one result per configuration."""
    drop_caches()
    touch_small_files(args.index)
    prime(args)
    limit = None if base == 0 else base + int(fraction * table)
    children: list[Child] = []
    runs = {c: {"config": c, "fraction": fraction, "limit": limit, "latencies_ms": [], "qps_call_ms": [],
                "disagree": 0} for c in configs}
    try:
        # mmap starts last: the memory reader's load drops the table's pages behind it (fadvise), which
        # would take from the page cache an mmap child had already filled.
        for config in sorted(configs, key=lambda c: c == "mmap"):
            try:
                children.append(Child(args, config, fraction, table, limit, f"{tag}_{config.replace('+', '')}", log))
            except RuntimeError as error:
                runs[config]["error"] = str(error)
        w, n = args.warmup, args.n
        for i, row in enumerate(rows[: w + n].tolist()):
            turn = children[i % len(children):] + children[: i % len(children)]
            answers = {child.config: child.ask({"rows": [row]}) for child in turn}
            if i >= w:
                for config, answer in answers.items():
                    runs[config]["latencies_ms"].append(answer["ms"])
                    runs[config]["disagree"] += answer["ids"] != answers[configs[0]]["ids"]
        for call in range(args.qps_calls):
            batch = rows[w + n + 32 * call: w + n + 32 * (call + 1)].tolist()
            for child in children[call % len(children):] + children[: call % len(children)]:
                runs[child.config]["qps_call_ms"].append(child.ask({"rows": batch})["ms"])
    finally:
        for child in children:
            runs[child.config].update(child.close())
    out = []
    for run in runs.values():
        if run["latencies_ms"]:
            run.update(percentiles(run["latencies_ms"]))
            run["qps"] = 32 * len(run["qps_call_ms"]) / (sum(run["qps_call_ms"]) / 1000) if run["qps_call_ms"] else None
            run["record_cache"] = run.get("reader", {}).get("record_cache")
        elif "error" not in run:
            run["error"] = "no answers"
        out.append(run)
    return out


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
                rows.append([f"{f:.0%}", config, "failed: " + mine[0]["error"][-80:], "", "", "", "", "", ""])
                continue
            cache = [r["record_cache"] for r in ok if r.get("record_cache")]
            rows.append([f"{f:.0%}", config, median([r["p50"] for r in ok]), median([r["p99"] for r in ok]),
                         median([r["qps"] for r in ok if r.get("qps")] or [float("nan")]),
                         median([c["hit_rate"] for c in cache]) if cache else "",
                         median([held_share(r) for r in ok]), max(int(r.get("cgroup_peak") or 0) for r in ok) / 2**20,
                         sum(r["disagree"] for r in ok)])
        ratios[f"{f:g}"] = round_ratios(runs, f)
    return rows, ratios


def held_share(run: dict[str, Any]) -> float:
    """The share of the table a configuration held in RAM at the end: mmap's resident pages of it,
    the cache's records (slots in use), the memory reader's copy, none for posix."""
    if run["config"] == "mmap":
        return run.get("memory", {}).get("table_in_page_cache", 0) / run["table_bytes"]
    if run["config"] == "posix+cache":
        return (run.get("record_cache") or {}).get("record_bytes", 0) / run["table_bytes"]
    return 1.0 if run["config"] == "memory" else 0.0


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
    # Imported here so that torch's and FAISS's library pages are mapped, and so charged, by this
    # process: otherwise the first child after each page-cache drop pays for them in its cgroup.
    from espn import Searcher  # noqa: F401

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, required=True)
    p.add_argument("--queries", type=Path, default=None, help="query embeddings (.npz); default INDEX.queries.npz")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="fractions of embeddings.bin")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n", type=int, default=200, help="measured single queries per configuration and round")
    p.add_argument("--warmup", type=int, default=400)
    p.add_argument("--qps-calls", type=int, default=8, help="measured calls of 32 queries per configuration and round")
    p.add_argument("--stream", choices=("zipf", "uniform"), default="zipf")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--topics", type=int, default=32)
    p.add_argument("--params", default="{}", help="JSON search overrides")
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
    base = 0
    if args.cgroups:  # what a posix process needs besides the table: its peak without a limit
        calibration = run_budget(args, 1.0, 0, table, stream(args.stream, len(queries.cls), need, topics, args.zipf,
                                                            seed=999), ["posix"], "base", work / "children.log")
        base = int(calibration[0].get("cgroup_peak") or 0) + (32 << 20)
        print(f"embeddings.bin {table / 2**20:.0f} MiB; base {base / 2**20:.0f} MiB (peak of posix without a "
              f"limit, +32 MiB)", file=sys.stderr)
    runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        rows = stream(args.stream, len(queries.cls), need, topics, args.zipf, seed=r)
        order = list(fractions)
        random.Random(r).shuffle(order)
        for f in order:
            configs = [c for c in CONFIGS if c != "memory" or f >= 1.0]
            random.Random(r * 31 + int(f * 100)).shuffle(configs)
            for run in run_budget(args, f, base, table, rows, configs, f"{r}_{f:g}", work / "children.log"):
                run["round"], run["table_bytes"] = r, table
                runs.append(run)
                print(f"round {r} {f:.0%} {run['config']}: " + (run.get("error", "")[-200:] or
                      f"p50 {run['p50']:.2f} ms, qps {run.get('qps') or 0:.1f}"), file=sys.stderr)
        # What the rounds so far measured (NAME.partial.json): a run stopped late keeps them.
        write_results(f"{args.name}.partial", {"index": str(args.index), "table_bytes": table, "base": base,
                                               "rounds_done": r + 1, "runs": runs, "stream": args.stream})
    shutil.rmtree(work, ignore_errors=True)  # the children's stderr; kept where a run raised
    rows, ratios = summarise(runs, fractions)
    headers = ["budget (of table)", "configuration", "p50 ms", "p99 ms", "batch-32 QPS", "cache hit rate",
               "table held in RAM (share)", "cgroup peak MiB", "answers differing"]
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
                  figure=plot(rows, fractions, f"{args.name} ({table / 2**20:.0f} MiB table): {args.stream} stream, "
                                               f"memory cgroup = base + budget"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
