"""What HTTP costs on this machine before any app runs: uvicorn answering with an app that does nothing.

    python -m benchmarks.bench_http_floor --rounds 5 --requests 500
    python -m benchmarks.bench_http_floor --quick

The floor under `bench_server --versus-library`'s "HTTP − library": uvicorn with each HTTP
parser it can use (h11, pure Python; httptools, C) serving `noop_app`, which reads the body
and answers a fixed 60-byte JSON, to one sequential keep-alive client (`http.client`, one
`send` per request), beside a TCP loopback round trip between two processes (two wake-ups,
no HTTP at all). Rounds alternate the parsers; tables give the median of each round's p50.
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import ROOT, free_port, machine, machine_line, markdown_table, median, write_results

PARSERS = ("h11", "httptools")
_ANSWER = b'{"query":"x","results":[],"stats":{"stage_ms":{"total":1.0}}}'


async def noop_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app that reads the request and answers `_ANSWER`: uvicorn's work, and nothing else."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(_ANSWER)).encode())]})
    await send({"type": "http.response.body", "body": _ANSWER})


def client_p50_ms(port: int, requests: int) -> float:
    """p50 of `requests` sequential POSTs on one keep-alive connection (after 20 unmeasured)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = b'{"query": "what is the speed of light", "k": 10}'
    times = []
    for i in range(requests + 20):
        started = time.perf_counter()
        connection.request("POST", "/v1/search", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.read() != _ANSWER:
            raise RuntimeError(f"unexpected answer from the no-op app (status {response.status})")
        if i >= 20:
            times.append((time.perf_counter() - started) * 1000)
    connection.close()
    return median(times)


def loopback_round_trip_ms(trips: int) -> float:
    """p50 of a one-byte TCP ping-pong with a child process (TCP_NODELAY both sides)."""
    server = socket.create_server(("127.0.0.1", 0))
    child = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys\n"
        "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
        "s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
        "while s.recv(1): s.sendall(b'y')\n"), str(server.getsockname()[1])])
    connection, _ = server.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(trips):
        started = time.perf_counter()
        connection.sendall(b"x")
        connection.recv(1)
        times.append((time.perf_counter() - started) * 1000)
    connection.close()
    server.close()
    child.wait(timeout=10)
    return median(times)


def serve(parser: str) -> tuple[subprocess.Popen, int]:
    """uvicorn serving `noop_app` with `parser`, once it answers."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "uvicorn", "benchmarks.bench_http_floor:noop_app", "--port",
                                str(port), "--http", parser, "--log-level", "warning", "--no-access-log"], cwd=ROOT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return process, port
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"uvicorn --http {parser} did not start")
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests", type=int, default=500, help="measured requests per parser and round")
    p.add_argument("--quick", action="store_true", help="2 rounds of 50 requests")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.requests = 2, 50
    info = machine()
    servers = {parser: serve(parser) for parser in PARSERS}
    p50: dict[str, list[float]] = {parser: [] for parser in PARSERS}
    loopback = []
    try:
        for round_ in range(args.rounds):
            for parser in (PARSERS if round_ % 2 == 0 else PARSERS[::-1]):
                p50[parser].append(client_p50_ms(servers[parser][1], args.requests))
            loopback.append(loopback_round_trip_ms(args.requests))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=10)
    rows = [[f"uvicorn --http {parser}, no-op app", ", ".join(f"{v:.3f}" for v in p50[parser]), median(p50[parser])]
            for parser in PARSERS]
    rows.append(["TCP loopback round trip (no HTTP)", ", ".join(f"{v:.3f}" for v in loopback), median(loopback)])
    print(f"# HTTP floor: {args.rounds} rounds of {args.requests} sequential requests; {machine_line(info)}; "
          f"pid {os.getpid()}")
    print(markdown_table(["one keep-alive client, p50 ms", "per round", "median"], rows))
    write_results("http_floor", {"machine": info, "rounds": args.rounds, "requests": args.requests,
                                 "p50_ms": p50, "loopback_ms": loopback})
    return 0


if __name__ == "__main__":
    sys.exit(main())
