"""How fast a serving worker picks up a new generation of a live index.

    python -m benchmarks.bench_reopen --index INDEX [--writes 10]
    python -m benchmarks.bench_reopen --index INDEX --quick       (3 writes: the CI smoke test)

On a copy of INDEX (never modified): a Searcher is open; each of `--writes` rounds upserts
one document (one generation) and times `Searcher.refresh()`, what a server worker runs at
the start of a request when live/CURRENT changed. Also times `refresh()` when nothing
changed (the per-request check: one stat).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from espn import Searcher
    from espn.live.checks import NewDocument
    from espn.live.live_index import LiveIndex

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, required=True)
    p.add_argument("--writes", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="3 writes (for the CI smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.writes = 3
    with tempfile.TemporaryDirectory(prefix="bench-reopen-") as tmp:
        work = Path(tmp) / "index"
        shutil.copytree(args.index, work)
        searcher = Searcher.open(work, verify="none")
        reopen_ms, check_us = [], []
        with LiveIndex.open(work) as writer:
            for i in range(args.writes):
                writer.upsert([NewDocument(f"reopen-{i}", f"reopen probe document {i} about protein folding")])
                started = time.perf_counter()
                newer = searcher.refresh()
                reopen_ms.append((time.perf_counter() - started) * 1000)
                assert newer is not None
                started = time.perf_counter()
                assert newer.refresh() is None
                check_us.append((time.perf_counter() - started) * 1e6)
                searcher.close()
                searcher = newer
        searcher.close()
    print(f"refresh after a write: median {statistics.median(reopen_ms):.1f} ms, max {max(reopen_ms):.1f} ms "
          f"over {args.writes} generations (1..{args.writes} deltas)")
    print(f"refresh with nothing new (the per-request check): median {statistics.median(check_us):.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
