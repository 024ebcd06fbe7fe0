"""Searches under injected transient I/O errors: do rankings stay those of the memory reader?

    python -m benchmarks.bench_faults --index scifact-index --n 600 --rate 0.05
    python -m benchmarks.bench_faults --index /tmp/espn-synth --queries-npz /tmp/espn-synth.queries.npz --quick

Each read engine in turn serves `--n` single-query searches (SciFact queries, or pre-encoded
ones) while a fraction `--rate` of its syscalls fail with errors the kernel documents as
transient: EAGAIN, EBUSY and EINTR at `io_uring_enter`; EAGAIN at `io_submit` and EINTR at
`io_getevents` (AIO); EAGAIN and EINTR at `preadv` (threads). They are injected through the
engines' public hook (`espn.store.engines.inject_faults`): the call is not made and fails
with that errno, as a loaded kernel would answer it. Every ranking is compared with the
memory reader's (same index, no I/O); a search either returns the same ranking or raises,
and both are counted. The issue-22 measurement: 600 SciFact searches at 5% on io_uring.
"""

from __future__ import annotations

import argparse
import errno
import random
import threading
import time
from collections import Counter
from pathlib import Path

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import (SCIFACT, SCIFACT_INDEX, load_queries, machine, machine_line, markdown_table,  # noqa: E402
                               take_queries, write_results)

#: What each engine's syscalls may answer transiently (io_uring_enter(2), io_submit(2), io_getevents(2)).
TRANSIENT_BY_ENGINE = {
    "io_uring": {"io_uring_enter": (errno.EAGAIN, errno.EBUSY, errno.EINTR)},
    "aio": {"io_submit": (errno.EAGAIN,), "io_getevents": (errno.EINTR,)},
    "threads": {"preadv": (errno.EAGAIN, errno.EINTR)},
}


def make_injector(engine: str, rate: float, seed: int):  # type: ignore[no-untyped-def]
    from espn.store.engines import FaultInjector

    class Transient(FaultInjector):
        def __init__(self) -> None:
            self.rng = random.Random(seed)
            self.lock = threading.Lock()
            self.armed = False
            self.injected: Counter[str] = Counter()

        def syscall(self, name: str) -> int:
            errnos = TRANSIENT_BY_ENGINE[engine].get(name)
            if not errnos or not self.armed:
                return 0
            with self.lock:
                if self.rng.random() >= rate:
                    return 0
                err = self.rng.choice(errnos)
                self.injected[f"{name} {errno.errorcode[err]}"] += 1
            return err

    return Transient()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", type=Path, default=SCIFACT_INDEX)
    p.add_argument("--queries", type=Path, default=SCIFACT / "queries.jsonl", help="BEIR queries (SciFact)")
    p.add_argument("--queries-npz", type=Path, help="pre-encoded queries instead of --queries")
    p.add_argument("--n", type=int, default=600, help="searches per engine (one query each)")
    p.add_argument("--rate", type=float, default=0.05, help="fraction of the engine's syscalls that fail")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--engines", default="", help="comma-separated (default: every engine this host allows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="20 searches per engine")
    args = p.parse_args(argv)
    n = 20 if args.quick else args.n

    from espn import Searcher
    from espn.store.engines import ENGINES, inject_faults

    names = [e for e in args.engines.split(",") if e] or [e for e, c in ENGINES.items() if c.unavailable_reason() is None]
    info = machine()
    with Searcher.open(args.index, reader="memory", with_encoder=args.queries_npz is None, verify="none") as ref:
        if args.queries_npz is not None:
            queries = load_queries(args.queries_npz)
        else:
            from espn.corpus import read_queries

            queries = ref.encoder.encode_queries([text for _, text in read_queries(args.queries)])
        n = min(n, len(queries))
        want = [[h.doc_id for h in ref.search_embeddings(take_queries(queries, [i]), k=args.k)[0].hits]
                for i in range(n)]
    rows, runs = [], []
    for name in names:
        injector = make_injector(name, args.rate, args.seed)
        differ, failed, kinds = 0, 0, Counter()
        with Searcher.open(args.index, reader="posix", with_encoder=False, verify="none",
                           reader_options={"io_engine": name}) as searcher, inject_faults(injector):
            injector.armed = True
            started = time.perf_counter()
            for i in range(n):
                try:
                    got = [h.doc_id for h in searcher.search_embeddings(take_queries(queries, [i]), k=args.k)[0].hits]
                except Exception as exc:  # noqa: BLE001 - counted: the measurement is how many surface
                    failed += 1
                    kinds[f"{type(exc).__name__}: {exc}"[:100]] += 1
                    continue
                differ += got != want[i]
            seconds = time.perf_counter() - started
            injector.armed = False
        injected = sum(injector.injected.values())
        rows.append([name, n, f"{args.rate:.0%}", injected, differ, failed, round(1000 * seconds / n, 2)])
        runs.append({"engine": name, "searches": n, "rate": args.rate, "injected": dict(injector.injected),
                     "rankings_differing": differ, "errors": failed, "error_kinds": dict(kinds),
                     "ms_per_search": 1000 * seconds / n})
    print(machine_line(info))
    print(markdown_table(["engine", "searches", "syscalls failing", "errors injected", "rankings ≠ memory reader",
                          "errors surfaced", "ms/search"], rows))
    write_results("faults", {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
