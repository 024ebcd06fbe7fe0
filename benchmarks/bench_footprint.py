"""Memory footprint: peak RSS and PSS of a serving process, posix reader against memory reader.

    python -m benchmarks.bench_footprint --index /tmp/espn-synth-2m
    python -m benchmarks.bench_footprint --index /tmp/espn-synth --quick

Each reader runs in a fresh process (`benchmarks.serve_child`): open the index, serve
`--n` queries (batch 1, prefetch on), then report its peak RSS (VmHWM) and its PSS
(/proc/self/smaps_rollup: shared file pages such as the memory-mapped FAISS index are
split between the processes that map them, which is what a host with several workers
pays). The mmap reader is shown for context: its RSS counts the file pages it touched,
which the kernel may evict. The page cache is dropped before each process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import drop_caches, machine, machine_line, markdown_table, median, run_json_child, write_results

READERS = ("posix", "memory", "mmap")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, required=True)
    p.add_argument("--queries", type=Path, default=None, help="default: INDEX.queries.npz")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="20 queries")
    p.add_argument("--name", default="footprint")
    args = p.parse_args(argv)
    if args.quick:
        args.n = 20
    queries = args.queries or args.index.with_name(args.index.name + ".queries.npz")
    info = machine()
    runs = []
    for r in range(args.repeats):
        for reader in READERS:
            drop_caches()
            res, err = run_json_child([sys.executable, "-m", "benchmarks.serve_child", "--index", str(args.index),
                                       "--queries", str(queries), "--reader", reader, "--n", str(args.n),
                                       "--warmup", "10", "--seed", str(r)])
            if res is None:
                print(f"{reader}: {err}", file=sys.stderr)
                continue
            runs.append({"reader": reader, "round": r, **res["memory"], "open_s": res["open_s"]})
            print(f"{reader}: {res['memory']}", file=sys.stderr)

    def med(reader: str, key: str) -> float:
        return median([x.get(key, float("nan")) for x in runs if x["reader"] == reader])

    table_bytes = (args.index / "embeddings.bin").stat().st_size
    rows = []
    for reader in READERS:
        rows.append([reader, med(reader, "peak_rss") / 2**20, med(reader, "pss") / 2**20, med(reader, "pss_anon") / 2**20,
                     med(reader, "pss_file") / 2**20, med(reader, "open_s"),
                     med("memory", "peak_rss") / med(reader, "peak_rss"), med("memory", "pss") / med(reader, "pss")])
    table = markdown_table(["reader", "peak RSS MiB", "PSS MiB", "PSS anon MiB", "PSS file MiB", "open s",
                            "memory ÷ this (peak RSS)", "memory ÷ this (PSS)"], rows)
    print(f"Index {args.index} ({table_bytes / 2**30:.2f} GiB embeddings.bin), {args.n} queries per process. "
          f"Machine: {machine_line(info)}\n\n{table}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([f"{r} peak RSS" for r in READERS], [med(r, "peak_rss") / 2**20 for r in READERS])
    ax.bar([f"{r} PSS" for r in READERS], [med(r, "pss") / 2**20 for r in READERS])
    ax.set_ylabel("MiB")
    ax.tick_params(axis="x", rotation=30)
    write_results(args.name, {"machine": info, "index": str(args.index), "table_bytes": table_bytes, "runs": runs}, fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
