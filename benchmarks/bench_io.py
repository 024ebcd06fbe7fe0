"""I/O efficiency: random 4 KiB O_DIRECT reads through each read engine against fio, IOPS
and CPU per read.

    python -m benchmarks.bench_io --file /data/io-test.bin              # any large file
    python -m benchmarks.bench_io --index /tmp/espn-synth-2m            # + the posix reader
    python -m benchmarks.bench_io --index /tmp/espn-synth --quick

fio (`--readonly --rw=randread --bs=4k --direct=1 --ioengine=io_uring --iodepth=32`) on
the same file gives the device's limit for this access pattern and what reading costs in
CPU when a C program drives io_uring. Each engine (`espn.store.engines`: io_uring, aio,
threads) is then driven the way the posix reader drives it: `--per-call` random aligned
4 KiB extents per call (default 2,048), at most `--depth` in flight (default 32, fio's
queue depth), one call after the other. CPU per read is the process's user + system time
(getrusage) over the reads; fio's own usr/sys percentages are converted the same way.
With `--index` the posix reader is measured too: its raw fetch of random blocks (plan +
engine, default engine at depth 16 and at its default 64) and `read()` of random
documents (I/O + parsing). Rounds alternate fio and the engines (`--repeats`); medians.

The issue's targets: the default engine at >= 80% of fio's IOPS, and <= 2 us CPU per
read. The kernel's share of a read is paid by fio too, so the table shows fio's CPU per
read next to each engine's.

fio is optional: `apt-get install -y fio` (Debian/Ubuntu), `dnf install fio`, or
`brew install fio`. Without it the script measures the engines alone and says so.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
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


def cpu_seconds() -> np.ndarray:
    """[user, system] CPU seconds of this process so far (every thread; system = the kernel's work)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return np.array([usage.ru_utime, usage.ru_stime])


def cpu_fields(cpu: np.ndarray, reads: int) -> dict[str, float]:
    """CPU microseconds per read: total, and the user part (Python and numpy, for the engines)."""
    per_read = 1e6 * cpu / max(reads, 1)
    return {"cpu_us_per_read": float(per_read.sum()), "user_us_per_read": float(per_read[0])}


def run_fio(path: Path, seconds: float, iodepth: int = 32, engine: str = "io_uring") -> dict | None:
    """IOPS, bytes/s and CPU per read of fio random 4 KiB direct reads, or None (reason printed)."""
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
    job = json.loads(proc.stdout[start:])["jobs"][0]
    read = job["read"]
    runtime_s = float(job.get("job_runtime", read.get("runtime", seconds * 1000))) / 1000
    ios = float(read.get("total_ios", 0)) or float(read["iops"]) * runtime_s
    cpu_s = (float(job["usr_cpu"]) + float(job["sys_cpu"])) / 100 * runtime_s
    return {"iops": float(read["iops"]), "bytes_per_s": float(read["bw_bytes"]), "engine": engine,
            "iodepth": iodepth, "lat_mean_us": float(read.get("clat_ns", {}).get("mean", 0)) / 1000,
            "cpu_us_per_read": 1e6 * cpu_s / ios if ios else float("nan"),
            "user_us_per_read": 1e6 * float(job["usr_cpu"]) / 100 * runtime_s / ios if ios else float("nan"),
            "usr_cpu_pct": float(job["usr_cpu"]), "sys_cpu_pct": float(job["sys_cpu"]), "cmd": " ".join(cmd)}


def open_direct(path: Path) -> tuple[int, bool]:
    """A read descriptor with O_DIRECT where the filesystem takes it (probed with one read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        probe = mmap.mmap(-1, BLOCK)
        try:
            os.preadv(fd, [memoryview(probe)], 0)
            return fd, True
        except OSError:
            os.close(fd)
        finally:
            probe.close()
    except OSError:
        pass
    return os.open(path, os.O_RDONLY), False


def run_engine(engine, fd: int, file_blocks: int, seconds: float, per_call: int, rng: np.random.Generator) -> dict:
    """`per_call` random aligned 4 KiB reads per engine call, one call after the other, for `seconds`."""
    buffer = np.frombuffer(mmap.mmap(-1, per_call * BLOCK), dtype=np.uint8)
    lengths = np.full(per_call, BLOCK, dtype=np.int64)
    at = np.arange(per_call, dtype=np.int64) * BLOCK
    engine.submit(fd, rng.integers(0, file_blocks, per_call) * BLOCK, lengths, buffer, at).wait()  # warm up
    reads = 0
    cpu, started = cpu_seconds(), time.perf_counter()
    while time.perf_counter() - started < seconds:
        offsets = rng.integers(0, file_blocks, per_call) * BLOCK
        engine.submit(fd, offsets, lengths, buffer, at).wait()
        reads += per_call
    dt, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return {"iops": reads / dt, "bytes_per_s": reads * BLOCK / dt, **cpu_fields(cpu, reads)}


def run_reader_blocks(reader, file_blocks: int, seconds: float, per_call: int, rng: np.random.Generator) -> dict:
    """The posix reader's raw fetch (plan + engine) of random aligned 4 KiB blocks, `per_call` per call."""
    n_ios = 0
    cpu, started = cpu_seconds(), time.perf_counter()
    while time.perf_counter() - started < seconds:
        blocks = np.unique(rng.integers(0, file_blocks, per_call))
        fetch = reader._submit(blocks * BLOCK, np.full(len(blocks), BLOCK, np.int64))
        try:
            _, _, nbytes, ios = fetch.complete()
        finally:
            fetch.release()  # the pooled buffer goes back
        n_ios += ios
    dt, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return {"iops": n_ios / dt, "bytes_per_s": n_ios * BLOCK / dt, **cpu_fields(cpu, n_ios)}


def run_reader_docs(reader, n_docs: int, seconds: float, per_call: int, rng: np.random.Generator) -> dict:
    """read() of random documents (I/O + parse), `per_call` per call."""
    n_ios = nbytes = docs = 0
    cpu, started = cpu_seconds(), time.perf_counter()
    while time.perf_counter() - started < seconds:
        picks = np.unique(rng.integers(0, n_docs, per_call))
        batch = reader.read(picks)
        n_ios, nbytes, docs = n_ios + batch.ios, nbytes + batch.bytes_read, docs + len(picks)
    dt, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return {"iops": n_ios / dt, "bytes_per_s": nbytes / dt, "docs_per_s": docs / dt, **cpu_fields(cpu, n_ios)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--index", type=Path, help="an index: reads its embeddings.bin, and measures the reader")
    source.add_argument("--file", type=Path, help="any large file: engines and fio only")
    p.add_argument("--seconds", type=float, default=None, help="per measurement (default 10; 1 with --quick)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--per-call", type=int, default=2048, help="extents (documents) per call")
    p.add_argument("--depth", type=int, default=32, help="reads in flight per engine (fio's --iodepth)")
    p.add_argument("--engines", default="", help="comma-separated (default: every engine this host allows)")
    p.add_argument("--quick", action="store_true", help="1 round of 1 s each, 256 per call")
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--name", default="io")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.per_call = 1, 256
    if args.seconds is None:
        args.seconds = 1.0 if args.quick else 10.0
    from espn.store.engines import ENGINES

    names = [n for n in args.engines.split(",") if n] or list(ENGINES)
    engines = {}
    for name in names:
        reason = ENGINES[name].unavailable_reason()
        if reason:
            print(f"engine {name} unavailable here: {reason}", file=sys.stderr)
        else:
            engines[name] = ENGINES[name](depth=args.depth)
    default_engine = next(iter(engines), "")

    readers: dict[int, Any] = {}
    records = None
    if args.index is not None:
        from espn.index import IndexDirectory
        from espn.store import PosixReader
        from espn.store.format import StoreLayout

        index = IndexDirectory.open(args.index, verify="none")
        store = index.manifest["store"]
        layout = StoreLayout.from_manifest(store)
        records = index.load_array("records.npy")
        path = index.file("embeddings.bin")
        readers = {d: PosixReader(path, records, layout, io_depth=d) for d in (16, 64)}
    else:
        path = args.file
    fd, direct = open_direct(path)
    if not direct:
        print("WARNING: O_DIRECT unavailable on this filesystem: the engines measure the page cache", file=sys.stderr)
    file_blocks = path.stat().st_size // BLOCK
    info = machine()
    rng = np.random.default_rng(0)
    rounds: list[dict] = []
    for r in range(args.repeats):
        row: dict[str, Any] = {"round": r}
        row["fio"] = None if args.no_fio else run_fio(path, args.seconds, args.depth)
        for name, engine in engines.items():
            row[f"engine_{name}"] = run_engine(engine, fd, file_blocks, args.seconds, args.per_call, rng)
        for depth, reader in readers.items():
            row[f"posix{depth}_blocks"] = run_reader_blocks(reader, file_blocks, args.seconds, args.per_call, rng)
        if readers and records is not None:
            row["posix64_docs"] = run_reader_docs(readers[64], len(records), args.seconds, args.per_call, rng)
        rounds.append(row)
        print(f"round {r}: " + ", ".join(f"{k} {v['iops']:.0f} IOPS {v['cpu_us_per_read']:.2f} us"
                                          for k, v in row.items() if isinstance(v, dict)), file=sys.stderr)
    reader_engine = readers[64].engine if readers else ""
    for reader in readers.values():
        reader.close()
    for engine in engines.values():
        engine.close()
    os.close(fd)

    def med(key: str, field: str) -> float:
        return median([row[key][field] for row in rounds if row.get(key)])

    fio_iops, fio_cpu = med("fio", "iops"), med("fio", "cpu_us_per_read")
    names_shown = {"fio": f"fio io_uring, direct, QD {args.depth} (device limit)"}
    for name in engines:
        names_shown[f"engine_{name}"] = (f"engine {name}{' (default)' if name == default_engine else ''}, "
                                         f"QD {args.depth}, {args.per_call} per call")
    if readers:
        names_shown["posix16_blocks"] = f"posix reader ({reader_engine}), raw 4 KiB blocks, io_depth 16"
        names_shown["posix64_blocks"] = f"posix reader ({reader_engine}), raw 4 KiB blocks, io_depth 64 (default)"
        names_shown["posix64_docs"] = f"posix reader ({reader_engine}), read() of random documents"
    table_rows: list[list[Any]] = []
    for key, label in names_shown.items():
        iops = med(key, "iops")
        table_rows.append([label, iops, med(key, "bytes_per_s") / 1e6,
                           100 * iops / fio_iops if fio_iops == fio_iops else float("nan"),
                           med(key, "cpu_us_per_read"), med(key, "user_us_per_read")])
    table = markdown_table(["path", "IOPS", "MB/s", "% of fio IOPS", "CPU us / read", "of which user"], table_rows)
    notes = []
    if fio_iops != fio_iops:
        notes.append("**fio not available: no device limit measured.**")
    elif default_engine:
        iops, cpu = med(f"engine_{default_engine}", "iops"), med(f"engine_{default_engine}", "cpu_us_per_read")
        user = med(f"engine_{default_engine}", "user_us_per_read")
        notes.append(f"Default engine {default_engine}: {100 * iops / fio_iops:.0f}% of fio's IOPS (target >= 80%), "
                     f"{cpu:.2f} us CPU per read, {user:.2f} of it in user space (target <= 2; "
                     f"fio itself: {fio_cpu:.2f}, {med('fio', 'user_us_per_read'):.2f} in user space).")
    print(f"File {path} ({path.stat().st_size / 2**30:.2f} GiB), O_DIRECT {direct}, {args.repeats} round(s) "
          f"of {args.seconds:g} s, {args.per_call} reads per call, depth {args.depth}. "
          f"Machine: {machine_line(info)}\n\n{table}" + "".join(f"\n\n{n}" for n in notes))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_iops, ax_cpu) = plt.subplots(1, 2, figsize=(10, 0.5 + 0.45 * len(table_rows)), sharey=True)
    labels = list(names_shown)[::-1]  # short unique keys: fio, engine_io_uring, posix64_blocks...
    ax_iops.barh(labels, [r[1] for r in table_rows][::-1])
    ax_iops.set_xlabel("random 4 KiB reads per second (IOPS)")
    ax_cpu.barh(labels, [r[4] for r in table_rows][::-1], color="tab:orange")
    ax_cpu.set_xlabel("CPU microseconds per read")
    fig.tight_layout()
    write_results(args.name, {"machine": info, "file": str(path), "direct": direct, "rounds": rounds,
                              "per_call": args.per_call, "depth": args.depth, "seconds": args.seconds,
                              "default_engine": default_engine}, fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
