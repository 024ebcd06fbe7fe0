"""Resharding without re-encoding, measured: `espn reshard` (espn.live.replication.reshard, run
in this process) splits 2 partitions into 3 and merges them back, with real writers (`espn serve
--publish --shard-map`, 1 worker each), moto's S3 server in this process, and one client writing
2 documents a second to the partitions' owners throughout.

Per move: the documents and their stored vectors (token records) copied, the bundles' bytes, how
long the move took (copying, catching up, frozen, switched, dropped) and how long its slots were
frozen; per reshard: the bytes the resharder fetched from the source partitions (a local copy of
each, restored once and then followed) and the documents any process encoded for it (none:
stored records are copied). Then time and bundle bytes per million token records.

    python -m benchmarks.bench_reshard --parts .espn/scifact-parts    # espn index ... --partitions 2
    python -m benchmarks.bench_reshard --quick                          # the sample corpus
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine, markdown_table, write_results
from benchmarks.scaleout import ESPN, HTTP, Cluster, Proc, Store

__all__ = ["main"]

SAMPLE = ROOT / "espn" / "data" / "sample_corpus.jsonl"


def _writes(writers: dict[int, Proc], url: str, stop: threading.Event, rate: float) -> None:
    """One client, `rate` PUTs a second, each to the writer that owns its id now (503s retried)."""
    from espn.live.replication.cluster import map_url, read_map
    from espn.live.replication.store import make_client

    client, where, i = make_client(), map_url(url), 0
    while not stop.is_set():
        shard_map = read_map(client, where)[0]  # type: ignore[index]
        doc_id = f"bench-{i}"
        writer = writers.get(shard_map.owner(doc_id))
        if writer is not None:
            answer = HTTP.put(f"{writer.base_url}/v1/documents/{doc_id}", timeout=60,
                              json={"text": f"a write while resharding {doc_id}"})
            i += answer.status_code in (200, 201)
        stop.wait(1 / rate)


def reshard(cluster: Cluster, parts: Path, work: Path, rate: float) -> dict[str, Any]:
    from espn.live.replication.reshard import Resharder

    url = cluster.store.url("bench-reshard")
    subprocess.run([ESPN, "shard-map", "init", url, "--partitions", "2"], env=cluster.env, check=True)
    writers: dict[int, Proc] = {}
    for p in range(2):
        shutil.copytree(parts / f"part-{p}", work / f"w{p}")
        writers[p] = cluster.writer(f"w{p}", work / f"w{p}", f"{url}/part-{p}", extra=["--shard-map", url])
    for writer in writers.values():
        writer.wait_ready()

    def announce(line: str) -> None:
        print(line, flush=True)
        if "start its writer" in line:
            writers[2] = cluster.writer("w2", work / "w2", f"{url}/part-2", extra=["--shard-map", url])

    stop = threading.Event()
    load = threading.Thread(target=_writes, args=(writers, url, stop, rate), daemon=True)
    load.start()
    runs = []
    try:
        for count in (3, 2):
            resharder = Resharder(url, work / f"resharder-{count}", announce=announce)
            started = time.monotonic()
            reports = resharder.run(count)
            runs.append({"to": count, "seconds": round(time.monotonic() - started, 1),
                         "source_bytes": resharder.source_bytes, "moves": [vars(r) for r in reports]})
    finally:
        stop.set()
        load.join(60)
    encoded = {p: (w.readyz().get("replication") or {}).get("documents_encoded") for p, w in writers.items()}
    return {"runs": runs, "writers_encoded": encoded}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=Path, default=ROOT / ".espn" / "scifact-parts",
                        help="a build of 2 partitions (part-0, part-1)")
    parser.add_argument("--rate", type=float, default=2.0, help="writes per second during the reshards")
    parser.add_argument("--quick", action="store_true", help="the sample corpus, built here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="espn-bench-reshard-") as tmp:
        work = Path(tmp)
        parts = _sample_parts(work) if args.quick else args.parts
        if not (parts / "part-0" / "manifest.json").is_file():
            parser.error(f"{parts}: no partitions (espn index CORPUS --out {parts} --partitions 2)")
        store = Store("espn-bench-reshard")
        cluster = Cluster(store, work)
        try:
            result = reshard(cluster, parts, work, args.rate)
        finally:
            cluster.stop()
            store.stop()
    rows = []
    for run in result["runs"]:
        for m in run["moves"]:
            per_million = m["seconds"] / (m["vectors"] / 1e6) if m["vectors"] else None
            rows.append([f"to {run['to']}: {m['source']}->{m['target']}", m["slots"], m["documents"], m["vectors"],
                         round(m["bundle_bytes"] / 1e6, 2), round(m["seconds"], 1), round(m["frozen_s"], 1),
                         None if per_million is None else round(per_million, 1),
                         round(m["bundle_bytes"] / m["vectors"] * 1e6 / 1e9, 2) if m["vectors"] else None])
    print(markdown_table(["move", "slots", "documents", "token records", "bundle MB", "s", "frozen s",
                          "s per M records", "bundle GB per M records"], rows))
    print(markdown_table(["reshard", "s", "fetched from sources (MB)"],
                         [[f"to {r['to']}", r["seconds"], round(r["source_bytes"] / 1e6, 1)] for r in result["runs"]]))
    print(f"documents encoded by the writers (their clients' writes and warm-ups only): {result['writers_encoded']}")
    write_results("reshard", {"machine": machine(), "parts": str(parts), **result})
    return 0


def _sample_parts(work: Path) -> Path:
    out = work / "sample-parts"
    subprocess.run([ESPN, "index", str(SAMPLE), "--out", str(out), "--partitions", "2", "--no-progress"], check=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
