"""What the typed client (`espn_client`) adds over raw HTTP: p50 of one sequential client, same queries.

    python -m benchmarks.bench_client                    # serves .espn/sample-index (built if missing)
    python -m benchmarks.bench_client --url http://127.0.0.1:8000 --api-key KEY
    python -m benchmarks.bench_client --quick            # 1 round of 5 requests (what the test runs)

Four callers post the same queries to the same server, one request at a time, each on its
own keep-alive connection: raw `httpx.Client` (`post(...).json()`), `espn_client.Client.search`,
raw `httpx.AsyncClient` and `espn_client.AsyncClient.search` (both awaited one request at a
time on one event loop). Each query is sent by the four back to back, in an order that
rotates from query to query, so that a load spike of a shared machine falls on all alike.
The table gives each caller's p50 per round, the median of the rounds, and for each client the
median over rounds of its per-query difference to the raw httpx caller of its kind (the
overhead); then the client's own work measured apart, in-process (the
request built; the answer's body streamed through the client's reader, which holds it to the
cap and the deadline; the answer validated into `SearchResponse`, against `json.loads`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import httpx

from benchmarks.common import ROOT, free_port, machine, machine_line, markdown_table, median, write_results
from espn_client import AsyncClient, Client, SearchResponse
from espn_client._core import Routes, search_call, search_params
from espn_client._exchange import DEFAULT_DEADLINE_S, DEFAULT_MAX_ANSWER_BYTES, AnswerReader, Deadline

SAMPLE_INDEX = ROOT / ".espn" / "sample-index"
QUERIES = ROOT / "espn" / "data" / "sample_queries.jsonl"
CALLERS = ("httpx", "Client", "httpx async", "AsyncClient")
#: Each caller of the client and the raw httpx caller it is compared with.
BASELINE = {"Client": "httpx", "AsyncClient": "httpx async"}


@contextlib.contextmanager
def served(index: Path) -> Iterator[str]:
    """`espn serve INDEX` on a free port (the sample index built first if it is missing), until ready."""
    espn = Path(sys.executable).parent / "espn"
    if not (index / "manifest.json").is_file():
        subprocess.run([str(espn), "index", str(ROOT / "espn" / "data" / "sample_corpus.jsonl"), "--out", str(index),
                        "--no-progress"], check=True)
    port = free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("ESPN_")}
    process = subprocess.Popen([str(espn), "serve", str(index), "--host", "127.0.0.1", "--port", str(port),
                                "--read-only"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        with Client(url) as probe:
            probe.wait_until_ready(timeout_s=300)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


class Callers:
    """The four callers, each with its own keep-alive connection, sending one search at a time."""

    def __init__(self, url: str, api_key: Optional[str], k: int) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.k = k
        self.http = httpx.Client(base_url=url, headers=headers, timeout=30.0)
        self.client = Client(url, api_key=api_key)
        self.loop = asyncio.new_event_loop()
        self.async_http = httpx.AsyncClient(base_url=url, headers=headers, timeout=30.0)
        self.async_client = AsyncClient(url, api_key=api_key)

    def search(self, caller: str, query: str) -> Any:
        if caller == "httpx":
            response = self.http.post("/v1/search", json={"query": query, "k": self.k})
            response.raise_for_status()
            return response.json()
        if caller == "Client":
            return self.client.search(query, k=self.k)
        if caller == "httpx async":
            return self.loop.run_until_complete(self._post(query))
        return self.loop.run_until_complete(self.async_client.search(query, k=self.k))

    async def _post(self, query: str) -> Any:
        response = await self.async_http.post("/v1/search", json={"query": query, "k": self.k})
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self.http.close()
        self.client.close()
        self.loop.run_until_complete(self.async_http.aclose())
        self.loop.run_until_complete(self.async_client.close())
        self.loop.close()


def one_round(url: str, api_key: Optional[str], queries: list[str], k: int, shift: int) -> dict[str, list[float]]:
    """Each query sent by the four callers back to back, their order rotating from query to
    query (a load spike on a shared machine hits all four alike); ms per request and caller,
    after 5 unmeasured queries. New connections each round."""
    callers = Callers(url, api_key, k)
    times: dict[str, list[float]] = {caller: [] for caller in CALLERS}
    try:
        for at, query in enumerate(queries[:5] + queries):
            for turn in range(len(CALLERS)):
                caller = CALLERS[(at + shift + turn) % len(CALLERS)]
                started = time.perf_counter()
                callers.search(caller, query)
                if at >= 5:
                    times[caller].append((time.perf_counter() - started) * 1000)
    finally:
        callers.close()
    return times


def client_work_us(url: str, api_key: Optional[str], query: str, k: int, repeats: int) -> dict[str, float]:
    """Microseconds of the client's own work per request, in-process: building the call, and
    validating one real answer into `SearchResponse` against plain `json.loads`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    content = httpx.post(f"{url}/v1/search", json={"query": query, "k": k}, headers=headers, timeout=30).content
    routes = Routes()
    call = search_call(routes, query, None, search_params(k, None, None, None, {}))
    request = httpx.Request("POST", f"{url}/v1/search")

    def read_answer() -> Any:
        response = httpx.Response(200, headers={"content-length": str(len(content))}, stream=httpx.ByteStream(content),
                                  request=request)
        reader = AnswerReader(response, call, DEFAULT_MAX_ANSWER_BYTES, Deadline(DEFAULT_DEADLINE_S))
        for chunk in response.iter_raw():
            reader.feed(chunk)
        return reader.answer()

    def per_call_us(work: Callable[[], Any]) -> float:
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(repeats):
                work()
            samples.append((time.perf_counter() - started) / repeats * 1e6)
        return median(samples)

    return {"build call": per_call_us(lambda: search_call(routes, query, None, search_params(k, None, None, None, {}))),
            "answer read (cap, deadline)": per_call_us(read_answer),
            "json.loads": per_call_us(lambda: json.loads(content)),
            "SearchResponse validate": per_call_us(lambda: SearchResponse.model_validate_json(content))}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: serve --index)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--index", type=Path, default=SAMPLE_INDEX, help="served when --url is not given")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--requests", type=int, default=200, help="measured requests per caller and round")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="1 round of 5 requests")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.requests = 1, 5
    texts = [json.loads(line)["text"] for line in QUERIES.read_text().splitlines() if line.strip()]
    queries = [texts[i % len(texts)] for i in range(args.requests)]
    info = machine()
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(served(args.index))
        p50: dict[str, list[float]] = {caller: [] for caller in CALLERS}
        # Per round, the median over its queries of (caller - httpx) on the same query, sent back to back.
        paired: dict[str, list[float]] = {caller: [] for caller in BASELINE}
        for round_ in range(args.rounds):
            times = one_round(url, args.api_key, queries, args.k, round_)
            for caller in CALLERS:
                p50[caller].append(median(times[caller]))
            for caller, base in BASELINE.items():
                paired[caller].append(median([a - b for a, b in zip(times[caller], times[base])]))
        work = client_work_us(url, args.api_key, texts[0], args.k, 200 if args.quick else 2000)
    rows = [[caller, ", ".join(f"{v:.3f}" for v in p50[caller]), median(p50[caller]),
             f"{median(paired[caller]) * 1000:+.0f} (vs {BASELINE[caller]})" if caller in BASELINE else ""]
            for caller in CALLERS]
    print(f"# Client overhead: {args.rounds} rounds of {args.requests} searches (k={args.k}), each sent by the four "
          f"callers back to back, one request at a time; {machine_line(info)}; pid {os.getpid()}")
    print(markdown_table(["one sequential caller", "p50 ms per round", "median p50 ms",
                          "client - raw httpx, same query (us, median of rounds)"], rows))
    print()
    print(markdown_table(["client's own work, in-process", "us per request"], [[n, v] for n, v in work.items()]))
    write_results("client_overhead", {"machine": info, "rounds": args.rounds, "requests": args.requests, "k": args.k,
                                      "p50_ms": p50, "paired_minus_httpx_ms": paired,
                                      "client_work_us": work})
    return 0


if __name__ == "__main__":
    sys.exit(main())
