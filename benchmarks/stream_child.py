"""One configuration of a lock-step comparison: a Searcher in its own process that searches
what its parent sends, one request at a time, so several configurations (each in its own
memory cgroup) take turns query by query and see the same load.

    python -m benchmarks.stream_child --index IDX --queries Q.npz --reader posix \
        --reader-options '{"record_cache_mb": 26}' [--preload]

Protocol (JSON lines): the child prints {"ready": ...} once open; then each line it reads is
{"rows": [query rows]} (searched as one call; it answers {"ms": ..., "bytes_read": ...}) or
{"stop": true} (it answers with its memory, its reader's description and exits).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import load_queries, rss_pss, take_queries  # noqa: E402
from benchmarks.serve_child import mapped_rss, preload  # noqa: E402


def page_cache_bytes(path: str) -> int:
    """Bytes of the file at `path` in the page cache now (mincore over a fresh read-only map)."""
    import ctypes  # only here: a measurement helper

    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                             ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vector = (ctypes.c_ubyte * (-(-size // page)))()
        try:
            if libc.mincore(ctypes.c_void_p(address), size, vector) != 0:
                return -1
        finally:
            libc.munmap(ctypes.c_void_p(address), size)
    finally:
        os.close(fd)
    return int(np.count_nonzero(np.frombuffer(vector, dtype=np.uint8) & 1)) * page


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--index", required=True)
    p.add_argument("--queries", required=True)
    p.add_argument("--reader", required=True)
    p.add_argument("--reader-options", default="{}")
    p.add_argument("--params", default="{}")
    p.add_argument("--preload", action="store_true", help="read embeddings.bin once through the page cache first")
    args = p.parse_args(argv)

    from espn import Searcher

    started = time.perf_counter()
    searcher = Searcher.open(args.index, reader=args.reader, verify="none", with_encoder=False,
                             reader_options=json.loads(args.reader_options))
    open_s = time.perf_counter() - started
    preload_s = preload(str(searcher.index.file("embeddings.bin"))) if args.preload else 0.0
    queries = load_queries(args.queries)
    params = json.loads(args.params)
    print(json.dumps({"ready": True, "open_s": open_s, "preload_s": preload_s}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("stop"):
            break
        rows = np.asarray(request["rows"], dtype=np.int64)
        t = time.perf_counter()
        results = searcher.search_embeddings(take_queries(queries, rows), **params)
        ms = (time.perf_counter() - t) * 1000
        print(json.dumps({"ms": ms, "bytes_read": sum(r.stats.bytes_read for r in results),
                          "ids": [h.doc_id for h in results[0].hits]}), flush=True)
    memory = {**rss_pss(), "table_rss": mapped_rss("embeddings.bin"), "cache_rss": mapped_rss("espn-rc-"),
              "table_in_page_cache": page_cache_bytes(str(searcher.index.file("embeddings.bin")))}
    print(json.dumps({"memory": memory, "reader": searcher.reader.describe()}), flush=True)
    searcher.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
