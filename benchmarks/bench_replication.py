"""Replication and partitioned serving, measured with real processes and a real S3-compatible
server (moto's, in this process):

1. Replication lag against write rate: a writer (`espn serve --publish`) takes PUTs at a fixed
   rate (open loop); a follower (`espn serve --follow`) is polled for each acknowledged id. Lag
   is the time from the write's acknowledgement to the follower serving it; p50 and p99.
2. Follower catch-up from empty: `espn serve EMPTY_DIR --follow` until /readyz answers, for a
   SciFact-sized index (median of repeats), beside the writer's first publish of it.
3. Router search latency: the same queries, one at a time, against one `espn serve` of the
   whole index and against `espn route` over 2 partition servers of the same documents,
   interleaved per repeat; p50 of each and their ratio.

    python -m benchmarks.bench_replication --index .espn/scifact-index --parts .espn/scifact-parts

Everything runs on this machine: the store, the writer, the followers and the load share its
cores, so the lag includes their contention. Writes: `--workers 1` servers, `nice` 0.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from benchmarks.common import (ROOT, SCIFACT, SCIFACT_INDEX, free_port, http, machine, markdown_table, median,
                               percentiles, read_jsonl, write_results)

ESPN = str(Path(sys.executable).with_name("espn"))
BUCKET = "espn-bench"


@contextlib.contextmanager
def process(command: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_ready(base: str, proc: subprocess.Popen, timeout_s: float = 600) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{base}: exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if http().get(f"{base}/readyz", timeout=2).status_code == 200:
                return time.perf_counter() - started
        time.sleep(0.05)
    raise RuntimeError(f"{base}: not ready after {timeout_s} s")


def serve(index: Path, *flags: str) -> tuple[list[str], str]:
    """The command of `espn serve INDEX` on a free port, and its base URL."""
    port = free_port()
    return ([ESPN, "serve", str(index), "--port", str(port), "--workers", "1", *flags], f"http://127.0.0.1:{port}")


async def lag_at_rate(writer: str, follower: str, rate: float, seconds: float, tag: str) -> dict[str, Any]:
    """Open-loop PUTs at `rate`/s for `seconds`. A write answered with generation g is on the
    follower from the moment the follower serves a generation >= g (generations are whole and
    ordered), which one poller of the follower's /readyz sees every 20 ms: polling each id
    would load the follower more than the writes do."""
    acked: list[tuple[float, int]] = []
    failed = 0
    seen: list[tuple[float, int]] = []
    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=60) as client:
        async def one(i: int) -> None:
            nonlocal failed
            doc_id = f"{tag}-{i}"
            answer = await client.put(f"{writer}/v1/documents/{doc_id}",
                                      json={"text": f"replication lag probe {doc_id} about tectonic plates"})
            if answer.status_code in (200, 201):
                acked.append((time.perf_counter(), answer.json()["generation"]))
            else:
                failed += 1

        async def watch() -> None:
            while not done.is_set():
                # a follower still starting answers /readyz without its replication section yet
                with contextlib.suppress(httpx.HTTPError, KeyError):
                    generation = (await client.get(f"{follower}/readyz")).json()["replication"]["generation"]
                    seen.append((time.perf_counter(), generation))
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        tasks = []
        started = time.perf_counter()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, started + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        newest = max((g for _, g in acked), default=0)
        deadline = time.perf_counter() + 300
        while (not seen or seen[-1][1] < newest) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        done.set()
        await watcher
    lags = []
    for at, generation in acked:
        visible = next((t for t, g in seen if t >= at and g >= generation), None)
        if visible is None:
            failed += 1
        else:
            lags.append(visible - at)
    stats = percentiles([lag * 1000 for lag in lags]) if lags else {}
    return {"rate": rate, "writes": len(lags), "failed": failed, "lag_ms": stats}


def search_latencies(base: str, queries: list[str], k: int) -> list[float]:
    out = []
    with httpx.Client(timeout=60) as client:
        for query in queries:
            started = time.perf_counter()
            answer = client.post(f"{base}/v1/search", json={"query": query, "k": k})
            answer.raise_for_status()
            out.append((time.perf_counter() - started) * 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--index", type=Path, default=SCIFACT_INDEX, help="one index of the corpus")
    parser.add_argument("--parts", type=Path, default=ROOT / ".espn" / "scifact-parts",
                        help="the same corpus as `espn index --partitions 2` (part-0, part-1)")
    parser.add_argument("--studies", default="catch-up,lag,search,ack", help="which of the four to run (comma-separated)")
    parser.add_argument("--ack-writes", type=int, default=40, help="writes per round of the ack study")
    parser.add_argument("--ack-rounds", type=int, default=3, help="alternating rounds of the ack study")
    parser.add_argument("--rates", default="1,2,5,10", help="write rates (per second) for the lag study")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of writes per rate")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of catch-up and of the search comparison")
    parser.add_argument("--queries", type=int, default=100, help="queries per search repeat")
    parser.add_argument("--query-file", type=Path, default=SCIFACT / "queries.jsonl",
                        help="BEIR queries.jsonl (their `text`)")
    parser.add_argument("--quick", action="store_true", help="a small run: 2 writes/s for 2 s, 1 repeat, 5 queries")
    args = parser.parse_args(argv)
    if args.quick:
        args.rates, args.seconds, args.repeats, args.queries = "2", 2.0, 1, 5
        args.ack_writes, args.ack_rounds = 4, 1
    studies = set(args.studies.split(","))
    for path in (args.index, *((args.parts / "part-0", args.parts / "part-1") if "search" in studies else ())):
        if not (path / "manifest.json").is_file():
            parser.error(f"{path}: no index (build it: espn index CORPUS --out {args.index} and "
                         f"espn index CORPUS --out {args.parts} --partitions 2)")

    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's access log: one line per request

    port = free_port()
    store = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    store.start()
    aws = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(aws)
    import boto3

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ESPN_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    url = f"s3://{BUCKET}/bench"
    results: dict[str, Any] = {"machine": machine(), "index": str(args.index)}
    work = Path(tempfile.mkdtemp(prefix="espn-bench-replication-"))
    try:
        if studies & {"catch-up", "lag"}:
            measure_lag(args, studies, work, env, url, results)
        if "search" in studies:
            results["search_p50_ms"] = compare_search(args, work, env)
        if "ack" in studies:
            results["ack"] = compare_acks(args, work, env, f"s3://{BUCKET}/ack")
    finally:
        store.stop()
        shutil.rmtree(work, ignore_errors=True)

    if results.get("lag"):
        print()
        print(markdown_table(["write rate (/s)", "writes", "lag p50 (ms)", "lag p99 (ms)", "failed"],
                             [[r["rate"], r["writes"], r["lag_ms"].get("p50"), r["lag_ms"].get("p99"), r["failed"]]
                              for r in results["lag"]]))
    if "search_p50_ms" in results:
        search = results["search_p50_ms"]
        print()
        print(markdown_table(["", "search p50 (ms), median of repeats"],
                             [["one index", median(search["one_index"])],
                              ["router, 2 partitions", median(search["router_2_partitions"])],
                              ["ratio", search["ratio"]]]))
    if "ack" in results:
        ack = results["ack"]
        print()
        print(markdown_table(["writer", "one at a time: p50 (ms)", "p99 (ms)", "4 clients: writes/s"],
                             [[name, row["p50_ms"], row["p99_ms"], row["writes_per_s"]] for name, row in ack.items()]))
    write_results("replication", results)
    return 0


def measure_lag(args: argparse.Namespace, studies: set[str], work: Path, env: dict[str, str], url: str,
                results: dict[str, Any]) -> None:
    """Studies 1 and 2: a writer publishing, a follower from empty (repeated), lag against write rate."""
    volume = work / "writer"
    shutil.copytree(args.index, volume)
    command, writer = serve(volume, "--publish", url, "--publish-interval-s", "0.2",
                            "--no-warmup")
    with process(command, work / "writer.log", env) as writer_proc:
        wait_ready(writer, writer_proc)
        started = time.perf_counter()
        # A fenced writer stands by (a follower's status, no published_generation) until its first
        # look at the store finds the lease free and takes it.
        while http().get(f"{writer}/readyz", timeout=10).json()["replication"].get("published_generation") is None:
            time.sleep(0.1)
        results["first_publish_s"] = round(time.perf_counter() - started, 2)
        size = sum(p.stat().st_size for p in args.index.rglob("*") if p.is_file())
        results["index_bytes"] = size

        # Catch-up from empty: the lag study's follower starts from an empty directory too, so
        # its start is the first run; the other repeats start (and stop) a follower each.
        catch_up = []
        for r in range(1, args.repeats if "catch-up" in studies else 0):
            command, follower = serve(work / f"empty-{r}", "--follow", url, "--no-warmup")
            started = time.perf_counter()
            with process(command, work / f"catch-up-{r}.log", env) as proc:
                wait_ready(follower, proc)
                catch_up.append(time.perf_counter() - started)
            shutil.rmtree(work / f"empty-{r}")

        command, follower = serve(work / "follower", "--follow", url, "--follow-interval-s", "0.2", "--no-warmup")
        started = time.perf_counter()
        with process(command, work / "follower.log", env) as proc:
            wait_ready(follower, proc)
            if "catch-up" in studies:
                catch_up.insert(0, time.perf_counter() - started)
                results["catch_up_s"] = {"runs": [round(s, 2) for s in catch_up],
                                         "median": round(median(catch_up), 2)}
                print(f"catch-up from empty: median {median(catch_up):.1f} s over {len(catch_up)} "
                      f"({size / 2**20:.0f} MiB index; first publish {results['first_publish_s']} s)", flush=True)
            lag_rows = []
            for rate in [float(r) for r in args.rates.split(",")] if "lag" in studies else []:
                row = asyncio.run(lag_at_rate(writer, follower, rate, args.seconds, f"r{rate:g}"))
                lag_rows.append(row)
                print(f"rate {rate:g}/s: {row['writes']} writes, lag p50 {row['lag_ms'].get('p50', 0):.0f} ms, "
                      f"p99 {row['lag_ms'].get('p99', 0):.0f} ms, failed {row['failed']}", flush=True)
            results["lag"] = lag_rows



def put_round(base: str, tag: str, writes: int, clients: int) -> tuple[list[float], float]:
    """`writes` PUTs by `clients` threads: each write's latency (ms) and the round's writes/s."""
    latencies: list[float] = []

    def one(i: int) -> None:
        started = time.perf_counter()
        answer = http().put(f"{base}/v1/documents/{tag}-{i}", timeout=120,
                            json={"text": f"acknowledgement probe {tag}-{i} about glacial moraines"})
        answer.raise_for_status()
        latencies.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(writes)))
    return latencies, writes / (time.perf_counter() - started)


def compare_acks(args: argparse.Namespace, work: Path, env: dict[str, str], url: str) -> dict[str, Any]:
    """A fenced writer against a writer that publishes nothing, rounds alternating (see study 4)."""
    volumes = {name: work / f"ack-{name}" for name in ("publish", "local")}
    for volume in volumes.values():
        shutil.copytree(args.index, volume)
    commands = {"publish": serve(volumes["publish"], "--publish", url), "local": serve(volumes["local"])}
    single: dict[str, list[float]] = {name: [] for name in commands}
    rates: dict[str, list[float]] = {name: [] for name in commands}
    with contextlib.ExitStack() as stack:
        for name, (command, base) in commands.items():
            wait_ready(base, stack.enter_context(process(command, work / f"ack-{name}.log", env)))
        for name, (_, base) in commands.items():  # the first writes of each (caches, the encoder's first batches)
            put_round(base, f"warm-{name}", 4, 1)
        for r in range(args.ack_rounds):
            for name, (_, base) in commands.items():
                single[name] += put_round(base, f"one-{r}", args.ack_writes, 1)[0]
                rates[name].append(put_round(base, f"four-{r}", args.ack_writes, 4)[1])
    return {("ack after the publish (--publish)" if name == "publish" else "ack on the local commit"): {
        "p50_ms": round(percentiles(single[name])["p50"], 1), "p99_ms": round(percentiles(single[name])["p99"], 1),
        "writes_per_s": round(median(rates[name]), 2), "rates": [round(r, 2) for r in rates[name]]}
        for name in commands}


def compare_search(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """Router over 2 partitions against one index of the same documents, interleaved per repeat."""
    queries = [row["text"] for row in read_jsonl(args.query_file)][: args.queries]
    commands = [serve(args.index, "--no-warmup")]
    commands += [serve(args.parts / f"part-{p}", "--no-warmup") for p in range(2)]
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(process(c, work / f"search-{i}.log", env)) for i, (c, _) in enumerate(commands)]
        for (_, base), proc in zip(commands, procs):
            wait_ready(base, proc)
        router_port = free_port()
        router = f"http://127.0.0.1:{router_port}"
        route = [ESPN, "route", "--shards", ",".join(base for _, base in commands[1:]), "--port", str(router_port)]
        router_proc = stack.enter_context(process(route, work / "router.log", env))
        wait_ready(router, router_proc)
        # Warm every server, the shards directly (first queries load pages and compile paths): a cold
        # shard's first answer can outlast the router's 2 s timeout on a busy machine (a 503).
        for base in [base for _, base in commands] + [router]:
            search_latencies(base, queries[:20], 10)
        whole, routed = [], []
        for _ in range(args.repeats):
            whole.append(median(search_latencies(commands[0][1], queries, 10)))
            routed.append(median(search_latencies(router, queries, 10)))
        return {"one_index": whole, "router_2_partitions": routed, "ratio": round(median(routed) / median(whole), 3)}


if __name__ == "__main__":
    sys.exit(main())
