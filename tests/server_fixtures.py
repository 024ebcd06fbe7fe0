"""Helpers for the HTTP server tests: run `espn serve` as a real process on a free port.

Imported by tests/test_server.py (tests/conftest.py belongs to the library tests).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import httpx
from helpers import HTTP_TIMEOUT_S, wait_until

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: The tests' one HTTP client. `HTTP.get()` and its siblings build a Client per call, and each
#: Client loads the CA bundle into a new SSL context: 56 ms of CPU on the CI VM, paid by every
#: poll of a readiness loop (half the CPU of the replication test's own process). Without
#: keep-alive each request still opens and closes its own connection, as `HTTP.get()` does.
#: Thread-safe: the concurrent tests share it. Its timeout is the tests' HTTP_TIMEOUT_S.
HTTP = httpx.Client(timeout=HTTP_TIMEOUT_S, limits=httpx.Limits(max_keepalive_connections=0))


def free_port() -> int:
    """A TCP port free on the loopback interface right now (bind port 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(index: Optional[Path], *flags: str) -> list[str]:
    """`espn serve [INDEX] FLAGS` (no INDEX: a server of named indexes only, --index-root)."""
    return [str(BIN / "espn"), "serve", *([str(index)] if index is not None else []), *flags]


class ServerProcess:
    """A running `espn serve` on 127.0.0.1:<free port>, its log captured to a file."""

    def __init__(self, command: list[str], port: int, log_path: Path, env: dict[str, str]) -> None:
        self.command = command
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        # A new session: the test can signal the server (and its workers) without touching itself.
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        cwd=REPO, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()[-6000:]}")
            return HTTP.get(f"{self.base_url}/readyz").status_code == 200

        wait_until(ready, lambda: f"the server to be ready ({timeout:.0f} s):\n{self.log()[-6000:]}",
                   timeout_s=timeout, interval_s=0.2, ignore=(httpx.HTTPError,))

    def terminate(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM, wait, then SIGKILL the whole process group if it is still there."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        # Workers of a killed supervisor could outlive it: end the group we created.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._log.close()
        return self.process.returncode


@contextlib.contextmanager
def running_server(index: Optional[Path], log_dir: Path, *flags: str, env: Optional[dict[str, str]] = None,
                   name: str = "server", fd_limit: Optional[int] = None,
                   espn: Sequence[str] = ()) -> Iterator[ServerProcess]:
    """Start `espn serve INDEX --port <free>` with `flags`, wait for /readyz, always stop it.

    fd_limit: start it under `ulimit -n` of this; espn: the command that stands for `espn`
    (default the installed one; a test may run a wrapper that behaves the same)."""
    port = free_port()
    full_env = {key: value for key, value in os.environ.items() if not key.startswith("ESPN_")}
    full_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    full_env.update(env or {})
    command = serve_command(index, "--host", "127.0.0.1", "--port", str(port), *flags)
    if espn:
        command = [*espn, *command[1:]]
    if fd_limit is not None:
        command = ["sh", "-c", f'ulimit -n {int(fd_limit)} && exec "$@"', "sh", *command]
    server = ServerProcess(command, port, log_dir / f"{name}.log", full_env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.terminate()


@contextlib.contextmanager
def s3_server(monkeypatch: Any, bucket: str) -> Iterator[tuple[Any, dict[str, str]]]:
    """A real S3-compatible server (moto's) on a free loopback port with `bucket` created; the
    AWS_* variables that reach it are set in this process and returned for child processes."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    store = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    store.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield store, env
    finally:
        store.stop()
