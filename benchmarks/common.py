"""What every benchmark shares: machine description, statistics, tables, result files, cgroups.

Each study is one script that measures every configuration it compares in one run (so
ratios hold on a noisy machine), takes medians over repeats, shuffles query order, and
writes `benchmarks/results/<name>.json` (raw numbers) and `<name>.png` (plot), printing
markdown tables to stdout.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

__all__ = [
    "ROOT", "RESULTS", "SCIFACT", "SCIFACT_INDEX", "machine", "percentiles", "median", "markdown_table",
    "write_results", "drop_caches", "can_drop_caches", "MemoryCgroup", "cgroup_unavailable_reason",
    "load_queries", "take_queries", "rss_pss",
]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("ESPN_BENCH_RESULTS", ROOT / "benchmarks" / "results"))
SCIFACT = Path(os.environ.get("ESPN_SCIFACT", ROOT.parent / "shared" / "data" / "scifact"))
#: Built by `espn index ../shared/data/scifact/corpus.jsonl.gz --out .espn/scifact-index` (bench_server.py builds it too).
SCIFACT_INDEX = Path(os.environ.get("ESPN_SCIFACT_INDEX", ROOT / ".espn" / "scifact-index"))


@functools.cache
def http() -> Any:
    """One `httpx.Client` for a benchmark's plain requests (readiness polls, /metrics).
    `httpx.get()` builds a Client per call, and each loads the CA bundle into a new SSL
    context: 56 ms of CPU on a 2-core VM, taken from the servers being measured. No
    keep-alive, so each request opens its own connection as `httpx.get()` does."""
    import httpx  # only the HTTP benchmarks need it

    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def machine() -> dict[str, Any]:
    """What the numbers were measured on; the load average says how shared the machine was."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
    with contextlib.suppress(Exception):
        import faiss
        import torch

        info["torch"], info["faiss"] = torch.__version__, faiss.__version__
        info["torch_threads"] = torch.get_num_threads()
    return info


def machine_line(info: dict[str, Any]) -> str:
    return (f"{info.get('cpu', '?')}, {info.get('cpus')} CPUs, {info.get('mem_gib')} GiB RAM, "
            f"load average {info['loadavg'][0]:.2f} at start (shared machine), {info['time']}")


def percentiles(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p99 of a list of latencies (ms)."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan"), "n": 0}
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "n": int(a.size)}


def median(values: Sequence[float]) -> float:
    a = [v for v in values if v is not None and np.isfinite(v)]
    return float(np.median(a)) if a else float("nan")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if not np.isfinite(value):
            return "n/a"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(name: str, payload: dict[str, Any], figure: Any | None = None) -> list[Path]:
    """benchmarks/results/NAME.json (and NAME.png when a matplotlib figure is given)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    written = []
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=_json_default))
    os.replace(tmp, path)
    written.append(path)
    if figure is not None:
        png = RESULTS / f"{name}.png"
        figure.savefig(png, dpi=110, bbox_inches="tight")
        written.append(png)
    for p in written:
        print(f"wrote {p}", file=sys.stderr)
    return written


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(type(obj))


# -- cold state ---------------------------------------------------------------------------

def can_drop_caches() -> bool:
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_caches() -> bool:
    """Write back and drop the page cache (root only); False when not permitted."""
    if not can_drop_caches():
        return False
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


# -- memory limits ------------------------------------------------------------------------

_V1 = Path("/sys/fs/cgroup/memory")
_V2 = Path("/sys/fs/cgroup")


def cgroup_unavailable_reason() -> str | None:
    """None when a memory cgroup can be created here (v1 or v2), else why not."""
    if (_V1 / "memory.limit_in_bytes").exists() or (_V1 / "cgroup.procs").exists():
        base = _V1
    elif (_V2 / "cgroup.controllers").exists() and "memory" in (_V2 / "cgroup.controllers").read_text():
        base = _V2
    else:
        return "no memory cgroup controller mounted under /sys/fs/cgroup"
    probe = base / f"espn_probe_{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return f"cannot create a cgroup under {base} ({exc.strerror}); run as root"
    return None


class MemoryCgroup:
    """A memory cgroup whose limit covers anonymous memory and page cache (v1 or v2).

    Start a process in it with `subprocess.Popen(..., preexec_fn=cg.enter)`.
    """

    def __init__(self, name: str, limit_bytes: int | None) -> None:
        self.v1 = (_V1 / "cgroup.procs").exists()
        self.path = (_V1 if self.v1 else _V2) / name
        self.path.mkdir(exist_ok=True)
        if limit_bytes is not None:
            if self.v1:
                (self.path / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))
                # Without swap this is a no-op, but be explicit: the limit is RAM + cache.
                with contextlib.suppress(OSError):
                    (self.path / "memory.memsw.limit_in_bytes").write_text(str(int(limit_bytes)))
            else:
                (self.path / "memory.max").write_text(str(int(limit_bytes)))
                with contextlib.suppress(OSError):
                    (self.path / "memory.swap.max").write_text("0")
        self.limit = limit_bytes

    def enter(self) -> None:
        """Move the calling process into the cgroup (runs in the child before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        with contextlib.suppress(OSError, ValueError):
            return int((self.path / name).read_text())
        return None

    def oom_kills(self) -> int:
        with contextlib.suppress(OSError):
            name = "memory.oom_control" if self.v1 else "memory.events"
            for line in (self.path / name).read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        return 0

    def remove(self) -> None:
        """Remove the cgroup; a process still in it after 5 s (a helper its child started, such
        as multiprocessing's resource tracker, outliving it) is killed first, so none is left."""
        for attempt in range(100):
            try:
                if self.v1:
                    with contextlib.suppress(OSError):
                        (self.path / "memory.force_empty").write_text("0")
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if attempt >= 50:
                    with contextlib.suppress(OSError, ValueError):
                        for pid in (self.path / "cgroup.procs").read_text().split():
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(int(pid), signal.SIGKILL)
                time.sleep(0.1)


@contextlib.contextmanager
def memory_cgroup(name: str, limit_bytes: int | None) -> Iterator[MemoryCgroup]:
    cg = MemoryCgroup(name, limit_bytes)
    try:
        yield cg
    finally:
        cg.remove()


# -- queries ------------------------------------------------------------------------------

def read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` rows of a JSON-lines file (gzipped when it ends in .gz): a benchmark's
    slice of a corpus or its queries."""
    import gzip

    opener: Any = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if limit is not None and len(rows) >= limit:
                    break
    return rows


def load_queries(path: Path):
    """QueryEmbeddings of every query in a query .npz file: flat (cls, bow, counts: what
    `load_query_embeddings` reads, as make_synthetic writes it) or padded (cls, bow, mask: what
    bench_centroid_reads writes)."""
    from espn.encoders import QueryEmbeddings
    from espn.encoders.precomputed import load_query_embeddings

    with np.load(path) as stored:
        if "mask" in stored:
            return QueryEmbeddings(stored["cls"], stored["bow"], stored["mask"])
    return load_query_embeddings(path)[1]


def take_queries(queries, rows: np.ndarray):
    """The queries at `rows` (a QueryEmbeddings subset)."""
    from espn.encoders import QueryEmbeddings

    rows = np.asarray(rows)
    return QueryEmbeddings(queries.cls[rows], queries.bow[rows], queries.mask[rows])


def rss_pss(pid: int | None = None) -> dict[str, int]:
    """Current RSS and PSS (bytes) from /proc/PID/smaps_rollup, and the peak RSS (VmHWM)."""
    pid = pid or os.getpid()
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss", "Pss_Anon", "Pss_File"):
                out[key.lower()] = int(rest.split()[0]) * 1024
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM"):
                out["peak_rss"] = int(line.split()[1]) * 1024
    return out


#: Set in every measured process. FAISS and torch each run OpenMP regions; with the default
#: (active) wait policy the threads of one spin after their region and starve the other's on
#: a small machine: measured on 2 cores, the sequential path's MaxSim took 50 ms instead of
#: 1 ms. PASSIVE makes idle OpenMP threads sleep. Override with ESPN_BENCH_OMP_WAIT_POLICY.
OMP_ENV = {"OMP_WAIT_POLICY": os.environ.get("ESPN_BENCH_OMP_WAIT_POLICY", "PASSIVE")}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server a benchmark starts)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def set_omp_env() -> None:
    """Apply OMP_ENV to this process; call before torch or faiss is imported."""
    for key, value in OMP_ENV.items():
        os.environ.setdefault(key, value)


def run_json_child(argv: list[str], preexec=None, timeout: float | None = None) -> tuple[dict[str, Any] | None, str]:
    """Run a child that prints one JSON object on its last stdout line; (object or None, stderr tail)."""
    env = {**os.environ, **OMP_ENV}
    proc = subprocess.run(argv, capture_output=True, text=True, preexec_fn=preexec, timeout=timeout, cwd=ROOT, env=env)
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not last:
        return None, f"exit {proc.returncode}: {proc.stderr[-800:]}"
    return json.loads(last[-1]), proc.stderr[-300:]


@contextlib.contextmanager
def cpu_load(processes: int) -> Iterator[str]:
    """`processes` CPU-bound children (a pure-Python busy loop each) for the duration of the block.

    Yields a one-line description for the tables. The children are ended by their own pids.
    """
    if processes <= 0:
        yield "none"
        return
    children = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        time.sleep(0.5)  # let them reach the scheduler's steady state
        yield f"{processes} CPU-bound process(es) (`python -c 'while True: pass'`) beside it"
    finally:
        for child in children:
            child.kill()
        for child in children:
            child.wait()
