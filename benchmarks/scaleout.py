"""Real processes for the scale-out runs (benchmarks/soak_scaleout.py and the tests that run its
scenarios short): an S3-compatible store (moto's server, in this process, with versioning on
so that an overwritten object shows), `espn serve` writers and followers, `espn route`, and
clients that write through them and keep what was acknowledged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import httpx

from benchmarks.common import ROOT, free_port

__all__ = ["ESPN", "CRASH_SERVE", "HTTP", "Store", "Proc", "Cluster", "Clients", "wait_for", "missing_after_restore",
           "paused"]

ESPN = str(Path(sys.executable).with_name("espn"))
#: `espn serve` that kills itself at the N-th pass of a named crash point (tests/crash_serve.py).
CRASH_SERVE = [sys.executable, str(ROOT / "tests" / "crash_serve.py")]
#: One client for polls and checks, no keep-alive (as tests/server_fixtures.py's).
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 120.0, interval_s: float = 0.2) -> None:
    """Poll `check` until it holds; TimeoutError naming `what` otherwise (HTTP errors count as not yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            if check():
                return
        time.sleep(interval_s)
    raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")


class Store:
    """moto's S3 server on a free loopback port, one bucket with versioning on; its AWS_* variables
    are set in this process (restore_from_store reads them) and given to the children."""

    def __init__(self, bucket: str) -> None:
        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise
        self.bucket, self.port = bucket, free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}", "AWS_ACCESS_KEY_ID": "test",
                    "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        os.environ.update(self.env)
        self.client = boto3.client("s3", endpoint_url=self.env["AWS_ENDPOINT_URL"])
        self.client.create_bucket(Bucket=bucket)
        self.client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def versions(self, prefix: str) -> dict[str, int]:
        """Every key under `prefix` and how many versions it has (2 or more: it was overwritten)."""
        counts: dict[str, int] = {}
        for page in self.client.get_paginator("list_object_versions").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in [*page.get("Versions", []), *page.get("DeleteMarkers", [])]:
                counts[item["Key"]] = counts.get(item["Key"], 0) + 1
        return counts

    def overwritten_records(self, prefix: str) -> list[str]:
        """Generation records written more than once (never, with fenced writers)."""
        return sorted(key for key, n in self.versions(f"{prefix}/generations/").items() if n > 1)

    def stop(self) -> None:
        self.server.stop()


class Proc:
    """One `espn` process in its own session (signals reach it and its workers), log to a file."""

    def __init__(self, name: str, command: list[str], port: int, log_dir: Path, env: dict[str, str]) -> None:
        self.name, self.port, self.base_url = name, port, f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        cwd=ROOT, start_new_session=True)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def readyz(self) -> dict[str, Any]:
        return HTTP.get(f"{self.base_url}/readyz", timeout=10).json()

    def wait_ready(self, timeout_s: float = 300.0) -> "Proc":
        def ready() -> bool:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            return HTTP.get(f"{self.base_url}/readyz", timeout=5).status_code == 200

        wait_for(ready, f"{self.name} to be ready", timeout_s)
        return self

    def stop(self) -> None:
        if self.alive():
            self.signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        self._log.close()


class Cluster:
    """The processes of one run, each always stopped at the end."""

    def __init__(self, store: Store, log_dir: Path) -> None:
        self.store, self.log_dir = store, log_dir
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ESPN_")}
        self.env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.env.update(store.env)
        self.procs: list[Proc] = []

    def spawn(self, name: str, args: Sequence[str], *, espn: Sequence[str] = (ESPN,), port: int | None = None,
              env: dict[str, str] | None = None) -> Proc:
        port = port or free_port()
        command = [*espn, *args, "--host", "127.0.0.1", "--port", str(port)]
        proc = Proc(name, command, port, self.log_dir, {**self.env, **(env or {})})
        self.procs.append(proc)
        return proc

    def writer(self, name: str, index: Path, url: str, *, lease_s: float = 4.0, crash_at: str | None = None,
               armed_by: Path | None = None, port: int | None = None, extra: Sequence[str] = ()) -> Proc:
        """`espn serve INDEX --publish URL` as writer `name`, advertising its own address. crash_at:
        `step:N`, it kills itself at the N-th pass of that crash point (counted once `armed_by`
        exists, when given: tests/crash_serve.py)."""
        port = port or free_port()
        args = ["serve", str(index), "--workers", "1", "--publish", url, "--publish-interval-s", "0.2",
                "--writer-name", name, "--writer-lease-s", str(lease_s), "--advertise-url",
                f"http://127.0.0.1:{port}", *extra]
        env = {"ESPN_TEST_CRASH_AT": crash_at} if crash_at else {}
        if armed_by is not None:
            env["ESPN_TEST_CRASH_ARMED_BY"] = str(armed_by)
        return self.spawn(name, args, espn=CRASH_SERVE if crash_at else [ESPN], port=port, env=env)

    def follower(self, name: str, index: Path, url: str, *, port: int | None = None, extra: Sequence[str] = ()) -> Proc:
        port = port or free_port()
        args = ["serve", str(index), "--workers", "1", "--no-warmup", "--follow", url, "--follow-interval-s", "0.3",
                "--advertise-url", f"http://127.0.0.1:{port}", *extra]
        return self.spawn(name, args, port=port)

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.stop()


class Clients:
    """Threads that write new documents to whichever writer takes them, each id until it is
    acknowledged (a PUT is safe to repeat) or the run ends; `acked` holds what was.

    targets(): the writers' base URLs to try, in order; a 503, a timeout or a refused connection
    moves on to the next one."""

    def __init__(self, targets: Callable[[], list[str]], prefix: str = "c", timeout_s: float = 5.0) -> None:
        self.targets, self.prefix, self.timeout_s = targets, prefix, timeout_s
        self.acked: dict[str, int] = {}  # id -> the generation its answer named
        self.attempted: set[str] = set()  # ids sent at least once (acknowledged or not)
        self.by_writer: dict[str, int] = {}
        self.refusals: dict[str, int] = {}  # error code (or exception) -> times
        self.latencies: list[float] = []
        self.preferred = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self._busy = 0
        self._threads: list[threading.Thread] = []

    def start(self, threads: int = 4) -> "Clients":
        self._threads = [threading.Thread(target=self._run, args=(t,), daemon=True) for t in range(threads)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        for thread in self._threads:
            thread.join(60)

    def pause(self) -> None:
        """No new write starts until `resume`; returns once the ones in flight are answered."""
        self._go.clear()
        wait_for(lambda: self._busy == 0, "the clients' writes in flight", 120, 0.05)

    def resume(self) -> None:
        self._go.set()

    def _refused(self, why: str) -> None:
        with self._lock:
            self.refusals[why] = self.refusals.get(why, 0) + 1

    def put(self, client: httpx.Client, doc_id: str) -> bool:
        """One id, to the writers in turn (the one that took the last write first) until one
        acknowledges it or the run stops."""
        body = {"text": f"scale-out write {doc_id} about fenced glaciers and moraines"}
        while not self._stop.is_set():
            targets = self.targets()
            for base in sorted(targets, key=lambda b: b != self.preferred):
                if self._stop.is_set():
                    return False
                started = time.perf_counter()
                with self._lock:
                    self.attempted.add(doc_id)
                try:
                    answer = client.put(f"{base}/v1/documents/{doc_id}", json=body, timeout=self.timeout_s)
                except httpx.HTTPError as exc:
                    self._refused(type(exc).__name__)
                    continue
                if answer.status_code in (200, 201):
                    self.preferred = base
                    with self._lock:
                        self.acked[doc_id] = int(answer.json()["generation"])
                        self.by_writer[base] = self.by_writer.get(base, 0) + 1
                        self.latencies.append(time.perf_counter() - started)
                    return True
                self._refused(str(answer.json().get("error", answer.status_code)) if answer.content else
                              str(answer.status_code))
            time.sleep(0.2)
        return False

    def _run(self, thread: int) -> None:
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=4)) as client:
            i = 0
            while not self._stop.is_set():
                self._go.wait()
                with self._lock:
                    self._busy += 1
                try:
                    self.put(client, f"{self.prefix}{thread}-{i}")
                finally:
                    with self._lock:
                        self._busy -= 1
                i += 1


def missing_after_restore(url: str, ids: Iterable[str], into: Path) -> list[str]:
    """The ids a fresh restore of the newest published generation at `url` does not hold, read by id."""
    from espn import Searcher
    from espn.errors import DocumentNotFoundError
    from espn.live.replication.restore import restore_from_store

    restore_from_store(url, into)
    missing = []
    with Searcher.open(into) as searcher:
        for doc_id in ids:
            try:
                searcher.document(doc_id)
            except DocumentNotFoundError:
                missing.append(doc_id)
    return missing


@contextlib.contextmanager
def paused(proc: Proc) -> Iterator[None]:
    """SIGSTOP the process (and its group) for the block, SIGCONT after."""
    proc.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.signal(signal.SIGCONT)
