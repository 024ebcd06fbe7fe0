"""I/O efficiency: random 4 KB read throughput of the posix reader against fio on the same file.

    python -m benchmarks.bench_io --index /tmp/espn-synth-2m
    python -m benchmarks.bench_io --index /tmp/espn-synth --quick

fio (`--rw=randread --bs=4k --direct=1 --ioengine=io_uring --iodepth=32`, read-only, on
embeddings.bin) gives the physical limit of the device for this access pattern. The
posix reader is measured on the same file three ways: its raw fetch of random aligned
4 KB blocks (`_submit`, the I/O path alone) with its default 16 threads and with 32
(fio's queue depth), and `read()` of random documents (I/O + parsing into tensors, what
a query pays). Rounds alternate fio and the reader (`--repeats`); medians reported.

fio is optional: `apt-get install -y fio` (Debian/Ubuntu), `dnf install fio`, or
`brew install fio`. Without it the script reports the reader alone and says so.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import machine, machine_line, markdown_table, median, write_results

BLOCK = 4096


def run_fio(path: Path, seconds: float, iodepth: int = 32, engine: str = "io_uring") -> dict | None:
    """IOPS and bytes/s of fio random 4 KB direct reads, or None (with the reason printed)."""
    if shutil.which("fio") is None:
        print("fio not installed (apt-get install -y fio); skipping the physical limit", file=sys.stderr)
        return None
    cmd = ["fio", "--name=espn-randread", f"--filename={path}", "--readonly", "--rw=randread", f"--bs={BLOCK}",
           "--direct=1", f"--ioengine={engine}", f"--iodepth={iodepth}", f"--runtime={seconds}", "--time_based",
           "--numjobs=1", "--group_reporting", "--output-format=json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        if engine == "io_uring":
            print(f"fio io_uring failed ({proc.stderr.strip()[-200:]}); retrying with libaio", file=sys.stderr)
            return run_fio(path, seconds, iodepth, "libaio")
        print(f"fio failed: {proc.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    start = proc.stdout.find("{")
    job = json.loads(proc.stdout[start:])["jobs"][0]["read"]
    return {"iops": float(job["iops"]), "bytes_per_s": float(job["bw_bytes"]), "engine": engine, "iodepth": iodepth,
            "lat_mean_us": float(job.get("clat_ns", {}).get("mean", 0)) / 1000, "cmd": " ".join(cmd)}


def run_reader_blocks(reader, file_blocks: int, seconds: float, per_call: int, rng: np.random.Generator) -> dict:
    """Raw fetch of random aligned 4 KB blocks, `per_call` per call, for `seconds`."""
    n_ios = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        blocks = np.unique(rng.integers(0, file_blocks, per_call))
        fetch = reader._submit(blocks * BLOCK, np.full(len(blocks), BLOCK, np.int64))
        _, _, nbytes, ios = fetch.complete()
        fetch.release()  # the pooled buffer back for the next call
        n_ios += ios
    dt = time.perf_counter() - started
    return {"iops": n_ios / dt, "bytes_per_s": n_ios * BLOCK / dt}


def run_reader_docs(reader, n_docs: int, seconds: float, per_call: int, rng: np.random.Generator) -> dict:
    """read() of random documents (I/O + parse), `per_call` per call."""
    n_ios = nbytes = docs = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        picks = np.unique(rng.integers(0, n_docs, per_call))
        batch = reader.read(picks)
        n_ios, nbytes, docs = n_ios + batch.ios, nbytes + batch.bytes_read, docs + len(picks)
    dt = time.perf_counter() - started
    return {"iops": n_ios / dt, "bytes_per_s": nbytes / dt, "docs_per_s": docs / dt}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, required=True)
    p.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--per-call", type=int, default=2048, help="blocks (documents) per reader call")
    p.add_argument("--quick", action="store_true", help="1 round of 1 s each")
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--name", default="io")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.repeats, args.per_call = 1.0, 1, 256
    from espn.index import IndexDirectory
    from espn.store import PosixReader
    from espn.store.format import StoreLayout

    index = IndexDirectory.open(args.index, verify="none")
    store = index.manifest["store"]
    layout = StoreLayout(store["d_cls"], store["d_bow"], store["block_size"])
    records = index.load_array("records.npy")
    path = index.file("embeddings.bin")
    file_blocks = path.stat().st_size // BLOCK
    readers = {t: PosixReader(path, records, layout, io_depth=t) for t in (16, 32)}
    if not readers[16].direct:
        print("WARNING: O_DIRECT unavailable on this filesystem: the reader measures the page cache", file=sys.stderr)
    info = machine()
    rng = np.random.default_rng(0)
    rounds: list[dict] = []
    for r in range(args.repeats):
        row: dict[str, Any] = {"round": r}
        row["fio"] = None if args.no_fio else run_fio(path, args.seconds)
        row["posix16_blocks"] = run_reader_blocks(readers[16], file_blocks, args.seconds, args.per_call, rng)
        row["posix32_blocks"] = run_reader_blocks(readers[32], file_blocks, args.seconds, args.per_call, rng)
        row["posix16_docs"] = run_reader_docs(readers[16], len(records), args.seconds, args.per_call, rng)
        rounds.append(row)
        print(f"round {r}: " + ", ".join(f"{k} {v['iops']:.0f} IOPS" for k, v in row.items()
                                          if isinstance(v, dict)), file=sys.stderr)
    for reader in readers.values():
        reader.close()

    def med(key: str, field: str) -> float:
        return median([row[key][field] for row in rounds if row.get(key)])

    fio_iops = med("fio", "iops")
    names = {"fio": "fio io_uring, direct, QD 32 (physical limit)",
             "posix16_blocks": "posix reader, raw 4 KB blocks, 16 threads (default)",
             "posix32_blocks": "posix reader, raw 4 KB blocks, 32 threads",
             "posix16_docs": "posix reader, read() of random documents, 16 threads"}
    table_rows: list[list[Any]] = []
    for key, name in names.items():
        iops = med(key, "iops")
        table_rows.append([name, iops, med(key, "bytes_per_s") / 1e6, 100 * iops / fio_iops if fio_iops else float("nan")])
    table = markdown_table(["path", "IOPS", "MB/s", "% of fio"], table_rows)
    fio_note = "" if fio_iops == fio_iops else "\n\n**fio not available: no physical limit measured.**"
    print(f"File {path} ({path.stat().st_size / 2**30:.2f} GiB), O_DIRECT {readers[16].direct}, {args.repeats} round(s) "
          f"of {args.seconds:.0f} s, {args.per_call} blocks per reader call. Machine: {machine_line(info)}\n\n{table}{fio_note}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([n.split(" (")[0] for n in names.values()][::-1], [r[1] for r in table_rows][::-1])
    ax.set_xlabel("random 4 KB reads per second (IOPS)")
    write_results(args.name, {"machine": info, "file": str(path), "direct": readers[16].direct, "rounds": rounds,
                              "per_call": args.per_call, "seconds": args.seconds}, fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
