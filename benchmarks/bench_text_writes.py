"""What keeping the full-text index live costs a write: the same writes with and without it.

    python -m benchmarks.bench_text_writes --index INDEX --corpus CORPUS
    python -m benchmarks.bench_text_writes --index INDEX --corpus CORPUS --quick

INDEX (built with a full-text index, the default) is never modified: two copies are made,
one written by `LiveIndex` with its text side (the default) and one with none
(`side_indexes=[]`, what every write did before the text side was kept live). Each round
writes `--batch` new documents as one upsert and then deletes one of them, on both copies
in turn (the order alternates by round), in this one process with one encoder, so the two
see the same machine. Reported: documents/s of the upserts (encoding included, as a
server's writes are), the delete's ms, their medians over rounds, and the ratios.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine, machine_line, markdown_table, median, read_jsonl, set_omp_env, write_results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, required=True)
    p.add_argument("--corpus", type=Path, required=True, help="documents to write (BEIR jsonl, .gz allowed)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--batch", type=int, default=4, help="documents per upsert")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="3 rounds of 2 documents (the test suite's run)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.batch = 3, 2
    set_omp_env()

    from espn.index import read_manifest
    from espn.live.checks import NewDocument
    from espn.live.live_index import LiveIndex

    if read_manifest(args.index).get("text") is None:
        raise SystemExit(f"{args.index} has no full-text index: build it with one (the default)")
    docs = read_jsonl(args.corpus, args.rounds * args.batch)
    work = Path(tempfile.mkdtemp(prefix="bench-text-writes-", dir=args.work))
    try:
        writers: dict[str, Any] = {}
        for name in ("text", "dense only"):
            shutil.copytree(args.index, work / name)
            writers[name] = LiveIndex(work / name, side_indexes=None if name == "text" else [])
        encoder = writers["text"].encoder()
        writers["dense only"]._encoder = encoder  # one encoder: the same forward passes for both
        assert [type(s).__name__ for s in writers["text"].side_indexes] == ["TextSide"]
        timings: dict[str, dict[str, list[float]]] = {name: {"docs_per_s": [], "delete_ms": []} for name in writers}
        for r in range(args.rounds):
            batch = docs[r * args.batch: (r + 1) * args.batch]
            order = list(writers) if r % 2 == 0 else list(reversed(writers))
            for name in order:
                new = [NewDocument(f"bench-{r}-{i}", d["text"], d.get("title") or "") for i, d in enumerate(batch)]
                started = time.perf_counter()
                writers[name].upsert(new)
                timings[name]["docs_per_s"].append(len(new) / (time.perf_counter() - started))
                started = time.perf_counter()
                writers[name].delete([new[0].doc_id])
                timings[name]["delete_ms"].append((time.perf_counter() - started) * 1000)
        summary = {name: {key: median(values) for key, values in t.items()} for name, t in timings.items()}
        ratio = {"docs_per_s": summary["text"]["docs_per_s"] / summary["dense only"]["docs_per_s"],
                 "delete_ms": summary["text"]["delete_ms"] / summary["dense only"]["delete_ms"]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = machine()
    print(machine_line(info))
    print(markdown_table(["writer", "upsert docs/s (median)", "delete ms (median)"],
                         [[name, s["docs_per_s"], s["delete_ms"]] for name, s in summary.items()]))
    print(f"text ÷ dense only: upsert throughput {ratio['docs_per_s']:.3f}×, delete time {ratio['delete_ms']:.2f}×")
    write_results("bench_text_writes_quick" if args.quick else "bench_text_writes",
                  {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "timings": timings,
                   "summary": summary, "ratio": ratio})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
