"""Connection limits, log flood control and the router's key, over real sockets against real
`espn serve` / `espn route` processes.

Under `ulimit -n 256`, 250 sockets that never send a byte and a body trickling one byte a
second must not stop a server from answering searches, and its log must stay small.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from espn_server.logs import JsonFormatter, RepeatFilter
from espn_server.settings import ServerSettings, default_max_connections
from helpers import wait_until
from server_fixtures import BIN, HTTP, free_port, running_server


@pytest.fixture
def index(sample_index: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "index"
    shutil.copytree(sample_index, copy)
    return copy


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return out


def _read_head(sock: socket.socket, timeout: float) -> bytes:
    """Bytes up to the first blank line: one response head (an interim "100 Continue" has no body)."""
    sock.settimeout(timeout)
    out = b""
    while not out.endswith(b"\r\n\r\n"):
        chunk = sock.recv(1)
        if not chunk:
            break
        out += chunk
    return out


def test_idle_sockets_and_a_trickling_body_under_ulimit_256_do_not_stop_searches(index: Path, tmp_path: Path) -> None:
    with running_server(index, tmp_path, "--no-warmup", "--header-timeout-s", "3", "--body-timeout-s", "2",
                        fd_limit=256) as server:
        settings_line = next(line for line in server.log().splitlines() if '"event": "settings"' in line)
        assert json.loads(settings_line)["max_connections"] is None  # derived: 160 under ulimit -n 256
        before = len(server.log().encode())
        idle = [_connect(server.port) for _ in range(250)]
        trickle = _connect(server.port)
        trickle.sendall(b"POST /v1/search HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                        b"content-length: 200\r\n\r\n")
        stop = threading.Event()

        def drip() -> None:
            while not stop.wait(0.5):
                try:
                    trickle.sendall(b" ")
                except OSError:
                    return

        dripping = threading.Thread(target=drip)
        dripping.start()
        try:
            started = time.monotonic()
            answered = []
            while time.monotonic() - started < 4:  # through the body timeout and into the header timeout
                answer = HTTP.post(f"{server.base_url}/v1/search", json={"query": "glacier melt", "k": 3})
                answered.append(answer.status_code)
            assert answered and set(answered) == {200}, answered
            timed_out = _read_all(trickle, 10)
            assert timed_out.startswith(b"HTTP/1.1 408"), timed_out[:200]
            assert b"did not arrive within 2 s" in timed_out
            closed = sum(1 for sock in idle if _read_all(sock, 5) == b"")  # EOF: the server closed it
            assert closed == 250
        finally:
            stop.set()
            dripping.join(10)
            for sock in [*idle, trickle]:
                sock.close()
        assert HTTP.get(f"{server.base_url}/readyz").status_code == 200

        def grown_lines() -> list[str]:
            return server.log().encode()[before:].decode(errors="replace").splitlines()

        # The access line follows the answer, so on a busy machine ours may not be written yet.
        wait_until(lambda: any('"/readyz"' in line and '"msg": "request"' in line for line in grown_lines()),
                   "the access line of our /readyz", timeout_s=30)
        # One access line per answered request (as many as the 4 s loop fits), and besides them
        # one summary per minute: nothing per idle connection.
        grown = grown_lines()
        others = [line for line in grown if '"msg": "request"' not in line]
        access = Counter((record["path"], record["status"])
                         for record in (json.loads(line) for line in grown if '"msg": "request"' in line))
        assert access[("/v1/search", 200)] == len(answered), access
        assert access[("/v1/search", 408)] == 1, access
        # Our /readyz above, and the fixture's last probe, whose line may be written just after
        # it was answered (the access line follows the answer): nothing else.
        assert set(access) <= {("/v1/search", 200), ("/v1/search", 408), ("/readyz", 200)}, access
        assert 1 <= access[("/readyz", 200)] <= 2, access
        assert sum(map(len, others)) < 16 << 10, "\n".join(others)[-3000:]
        assert "out of system resource" not in server.log()
        assert "connection limits at work" in server.log()


def test_past_the_cap_with_every_connection_busy_a_new_one_gets_503(index: Path, tmp_path: Path) -> None:
    """--max-connections 4: four connections each mid-request (a body still to come) are busy; a
    fifth is answered 503 at once and closed; once they finish, searches are answered again."""
    with running_server(index, tmp_path, "--no-warmup", "--max-connections", "4", "--body-timeout-s", "3") as server:
        busy = []
        for _ in range(4):
            sock = _connect(server.port)
            sock.sendall(b"POST /v1/search HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"expect: 100-continue\r\ncontent-length: 50\r\n\r\n{")
            busy.append(sock)
        for sock in busy:  # "100 Continue": the server read its headers and reads its body, so it is busy
            assert _read_head(sock, 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
        refused = _connect(server.port)
        answer = _read_all(refused, 5)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"] == "overloaded"
        for sock in busy:  # the body timeout ends them: 408
            assert _read_all(sock, 10).startswith(b"HTTP/1.1 408")
            sock.close()
        refused.close()
        assert HTTP.post(f"{server.base_url}/v1/search", json={"query": "glacier", "k": 2}).status_code == 200


def test_a_max_connections_at_the_descriptor_limit_is_refused_at_start(index: Path) -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    with pytest.raises(ValueError, match="below the open-file limit"):
        ServerSettings(index=index, max_connections=soft)
    assert default_max_connections(256) == 160 and default_max_connections(1024) == 640
    assert default_max_connections(1 << 20) == 65_536


def test_one_error_repeated_a_hundred_thousand_times_logs_a_few_lines() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    now = [0.0]
    handler.addFilter(RepeatFilter(burst=5, period_s=60.0, clock=lambda: now[0]))
    log = logging.getLogger("test.flood")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        for _ in range(100_000):
            log.error("socket.accept() out of system resource")
        log.info("an info line is never held back")
        log.error("another message has its own budget")
        now[0] = 61.0  # a minute later
        log.error("socket.accept() out of system resource")
    finally:
        log.removeHandler(handler)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    flood = [line for line in lines if line["msg"] == "socket.accept() out of system resource"]
    assert len(flood) == 6 and flood[-1]["suppressed"] == 99_995
    assert any(line["msg"] == "an info line is never held back" for line in lines)
    assert any(line["msg"] == "another message has its own budget" for line in lines)
    assert len(out.getvalue()) < 4096


def _start_router(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int, Path]:
    port = free_port()
    log = tmp_path / "route.log"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ESPN_")} | env
    with open(log, "wb") as out:
        process = subprocess.Popen([str(BIN / "espn"), "route", "--shards", f"http://127.0.0.1:{free_port()}",
                                    "--timeout-ms", "300", "--host", "127.0.0.1", "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)

    def listening() -> bool:
        assert process.poll() is None, log.read_text()[-2000:]  # not ignored: a router that exited fails at once
        HTTP.get(f"http://127.0.0.1:{port}/healthz")
        return True

    wait_until(listening, lambda: f"espn route to listen:\n{log.read_text()[-2000:]}", timeout_s=60, interval_s=0.3,
               ignore=(httpx.TransportError,))
    return process, port, log


@pytest.fixture
def router(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    key = "router-key-" + "x" * 24
    process, port, log = _start_router(tmp_path, {"ESPN_API_KEY": key})
    try:
        yield f"http://127.0.0.1:{port}", log
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def test_the_router_takes_the_servers_key_answers_401_before_parsing_and_logs_no_query(
        router: tuple[str, Path]) -> None:
    base, log = router
    key = "router-key-" + "x" * 24
    malformed = HTTP.post(f"{base}/v1/search", content=b'{"query": ', headers={"content-type": "application/json"})
    assert malformed.status_code == 401 and malformed.json()["error"] == "unauthorized"
    assert HTTP.post(f"{base}/v1/search?api_key={key}", json={"query": "q"}).status_code == 401
    wrong = HTTP.post(f"{base}/v1/search", json={"query": "q"}, headers={"Authorization": "Bearer " + "y" * 40})
    assert wrong.status_code == 401
    keyed = {"Authorization": f"Bearer {key}"}
    assert HTTP.post(f"{base}/v1/search", content=b'{"query": ',
                     headers={**keyed, "content-type": "application/json"}).status_code in (400, 422)
    passed = HTTP.post(f"{base}/v1/search?secret=hunter2", json={"query": "q"}, headers=keyed)
    assert passed.status_code == 503 and passed.json()["error"] == "no_shard_answered"  # past the key: no shard runs
    assert HTTP.get(f"{base}/healthz").status_code == 200  # health needs no key

    def access_lines() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{") and '"request"' in line]

    # The access line follows the answer: wait for the last request's (the /healthz above).
    wait_until(lambda: any(line["path"] == "/healthz" for line in access_lines()), "the router's /healthz access line",
               timeout_s=10, interval_s=0.05)
    text = log.read_text()
    access = access_lines()
    assert {line["status"] for line in access} >= {401, 503}
    assert all(line["path"] == "/v1/search" or line["path"] == "/healthz" for line in access)
    assert key not in text and "hunter2" not in text and "api_key" not in text


def test_the_router_refuses_a_short_key(tmp_path: Path) -> None:
    result = subprocess.run([str(BIN / "espn"), "route", "--shards", "http://127.0.0.1:9"],
                            env={k: v for k, v in os.environ.items() if not k.startswith("ESPN_")}
                            | {"ESPN_API_KEY": "short"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "ESPN_ROUTER_API_KEY" in result.stderr and "at least 16" in result.stderr
