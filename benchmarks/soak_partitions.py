"""A partitioned index behind `espn route --shard-map`, with real processes and a real
S3-compatible store (moto's):

- replica-kill: 2 partitions x 2 replicas (`espn serve --follow`, registered in the map), the
  same searches run twice through the router (4 at a time), once healthy and once while one
  replica is killed with SIGKILL a third of the way in: no search may fail and every ranking must
  be the healthy run's (the same ids in the same order; scores equal to float32 rounding: a
  query the server encodes in a batch with other concurrent ones differs in the last bits);
- split-merge: 2 writers (`espn serve --publish --shard-map`), 4 clients writing through the
  router, `espn reshard --partitions 3` (a third writer started for the new partition when the
  resharder asks), then `espn reshard --partitions 2`, writes going on throughout. After each:
  every acknowledged document is found through the router by id and by search, exactly one
  partition holds it, no writer encoded more documents than the PUTs it took (the moved ones
  are copied, never encoded) and the resharder itself encoded none.

    python -m benchmarks.soak_partitions                         # 1,000 searches; 60 s of writes
    python -m benchmarks.soak_partitions --quick                 # 300 searches; a few seconds of writes

tests/test_shard_map.py runs both short (the same code).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import ROOT, machine, markdown_table, write_results
from benchmarks.scaleout import ESPN, HTTP, Clients, Cluster, Proc, Store, wait_for

__all__ = ["replica_kill", "split_and_merge", "check", "main"]

SAMPLE = ROOT / "espn" / "data" / "sample_corpus.jsonl"


def _espn(cluster: Cluster, *args: str, log: Path | None = None) -> str:
    done = subprocess.run([ESPN, *args], env=cluster.env, capture_output=True, text=True, timeout=900)
    if log is not None:
        log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"espn {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def _members(cluster: Cluster, url: str) -> dict[int, int]:
    shown = json.loads(_espn(cluster, "shard-map", "show", url))
    return {p["partition"]: len(p["members"]) for p in shown["partitions"] if not p["retired"]}


def _router(cluster: Cluster, url: str) -> Proc:
    return cluster.spawn("router", ["route", "--shard-map", url, "--timeout-ms", "30000", "--write-timeout-ms",
                                    "30000"]).wait_ready()


def _queries(n: int) -> list[str]:
    texts = [json.loads(line)["text"] for line in SAMPLE.read_text().splitlines()[:100]]
    return [" ".join(texts[i % len(texts)].split()[:8]) for i in range(n)]


def _search_all(router: Proc, queries: list[str], during: Callable[[int], None] = lambda i: None,
                threads: int = 4) -> tuple[list[Any], int]:
    """Each query's ranking through the router ([id, score] pairs; None for a failed search), and the failures."""

    def one(i: int) -> Any:
        during(i)
        try:
            answer = HTTP.post(f"{router.base_url}/v1/search", json={"query": queries[i], "k": 10}, timeout=60)
        except Exception:  # noqa: BLE001 - a failed search, counted
            return None
        body = answer.json()
        if answer.status_code != 200 or body.get("partial"):
            return None
        return [[hit["id"], hit["score"]] for hit in body["results"]]

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        rankings = list(pool.map(one, range(len(queries))))
    return rankings, sum(r is None for r in rankings)


def replica_kill(cluster: Cluster, parts: Path, tmp: Path, searches: int) -> dict[str, Any]:
    """2 partitions x 2 replicas; the same searches healthy and with one replica killed (SIGKILL)."""
    url = cluster.store.url("replicated")
    _espn(cluster, "shard-map", "init", url, "--partitions", "2")
    for p in range(2):
        _espn(cluster, "publish", str(parts / f"part-{p}"), f"{url}/part-{p}")
    followers = [cluster.follower(f"f{p}{j}", tmp / "replicas" / f"f{p}{j}", f"{url}/part-{p}")
                 for p in range(2) for j in range(2)]
    for follower in followers:
        follower.wait_ready()
    wait_for(lambda: _members(cluster, url) == {0: 2, 1: 2}, "each replica to register", 60)
    router = _router(cluster, url)
    time.sleep(3)  # a poll of the map: the router sees both replicas of each partition
    queries = _queries(searches)
    healthy, healthy_failed = _search_all(router, queries)
    victim = followers[0]

    def kill_at_a_third(i: int) -> None:
        if i == searches // 3:
            victim.signal(signal.SIGKILL)

    killed, killed_failed = _search_all(router, queries, kill_at_a_third)
    pairs = [(a, b) for a, b in zip(healthy, killed) if a is not None and b is not None]
    differ = [i for i, (a, b) in enumerate(pairs) if [hit[0] for hit in a] != [hit[0] for hit in b]]
    delta = max((abs(x[1] - y[1]) for a, b in pairs for x, y in zip(a, b)), default=0.0)
    return {"scenario": "replica-kill", "searches": searches, "healthy_failed": healthy_failed,
            "failed": killed_failed, "rankings_differ": differ[:20], "max_score_delta": delta,
            "victim_alive": victim.alive()}


def split_and_merge(cluster: Cluster, parts: Path, tmp: Path, seconds: float) -> dict[str, Any]:
    """Writes through the router while `espn reshard` splits 2 partitions into 3, then merges back."""
    url = cluster.store.url("resharded")
    _espn(cluster, "shard-map", "init", url, "--partitions", "2")
    writers = {}
    for p in range(2):
        shutil.copytree(parts / f"part-{p}", tmp / "writers" / f"w{p}")
        writers[p] = cluster.writer(f"w{p}", tmp / "writers" / f"w{p}", f"{url}/part-{p}", extra=["--shard-map", url])
    for writer in writers.values():
        writer.wait_ready()
    router = _router(cluster, url)
    base = _live(writers)
    clients = Clients(lambda: [router.base_url], prefix="r").start(4)
    result: dict[str, Any] = {"scenario": "split-merge", "seconds": seconds}
    try:
        time.sleep(seconds / 3)
        log = tmp / "reshard-3.log"
        resharder = subprocess.Popen([ESPN, "reshard", url, "--partitions", "3", "--work", str(tmp / "work-3"),
                                      "--wait-s", "300"], env=cluster.env, stdout=open(log, "w"),
                                     stderr=subprocess.STDOUT)
        wait_for(lambda: "start its writer" in log.read_text() or resharder.poll() is not None,
                 "the resharder to create partition 2", 300)
        writers[2] = cluster.writer("w2", tmp / "writers" / "w2", f"{url}/part-2", extra=["--shard-map", url])
        writers[2].wait_ready()
        if resharder.wait(900) != 0:
            raise RuntimeError(f"espn reshard --partitions 3 failed:\n{log.read_text()[-4000:]}")
        result["split"] = _reshard_lines(log)
        time.sleep(seconds / 3)
        clients.pause()  # the check counts documents: writes wait for it (they went on all through the reshard)
        result["after_split"] = _verify(router, writers, clients, base)
        clients.resume()
        _espn(cluster, "reshard", url, "--partitions", "2", "--work", str(tmp / "work-2"), "--wait-s", "300",
              log=tmp / "reshard-2.log")
        result["merge"] = _reshard_lines(tmp / "reshard-2.log")
        time.sleep(seconds / 3)
    finally:
        clients.stop()
    result["after_merge"] = _verify(router, writers, clients, base)
    result["acknowledged"] = len(clients.acked)
    result["encoded_vs_puts"] = {p: _encoded_and_puts(w) for p, w in writers.items()}
    return result


def _reshard_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith(("move-", "s3://", "documents encoded"))]


def _live(writers: dict[int, Proc]) -> int:
    return sum(int((w.readyz().get("replication") or {}).get("live_documents", 0)) for w in writers.values()
               if w.alive())


def _verify(router: Proc, writers: dict[int, Proc], clients: Clients, base: int) -> dict[str, Any]:
    """Every acknowledged id found through the router by id (from the partition that owns it) and
    by search, and held once: the partitions' live documents add up to the build's, the
    acknowledged ones and those written without an answer (the last in flight) that are there."""
    acked = sorted(dict(clients.acked))
    unanswered = sorted(clients.attempted - set(acked))

    def routed(doc_id: str) -> bool:
        return HTTP.get(f"{router.base_url}/v1/documents/{doc_id}", timeout=30).status_code == 200

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        found = list(pool.map(routed, acked + unanswered))
    not_by_id = [doc_id for doc_id, ok in zip(acked, found) if not ok]
    expected = base + len(acked) + sum(found[len(acked):])
    not_by_search = []
    for at in range(0, len(acked), 100):
        chunk = acked[at: at + 100]
        answer = HTTP.post(f"{router.base_url}/v1/search/batch", timeout=120, json={
            "queries": [f"scale-out write {doc_id}" for doc_id in chunk], "k": 10, "mode": "lexical"}).json()
        for doc_id, response in zip(chunk, answer["responses"]):
            if [hit["id"] for hit in response["results"]].count(doc_id) != 1:
                not_by_search.append(doc_id)
    return {"checked": len(acked), "not_by_id": not_by_id[:20], "not_by_search": not_by_search[:20],
            "live_documents": _live(writers), "expected_documents": expected}


def _encoded_and_puts(writer: Proc) -> list[int]:
    """[documents the writer encoded, PUTs it answered (+1 for its warm-up)]: a move's documents,
    were they encoded, would be hundreds more than the PUTs."""
    status = writer.readyz().get("replication") or {}
    puts = sum('"method": "PUT"' in line for line in writer.log().splitlines())
    return [int(status.get("documents_encoded", -1)), puts + 1]


def check(result: dict[str, Any]) -> None:
    """AssertionError naming what a scenario broke."""
    if result["scenario"] == "replica-kill":
        assert result["healthy_failed"] == 0 and result["failed"] == 0, result
        # Ids in the same order; scores equal but for the last bits of float32 (a query encoded in
        # another batch of concurrent ones: the same on one replica as on the other).
        assert not result["rankings_differ"] and result["max_score_delta"] < 1e-5, result
        assert not result["victim_alive"], result
        return
    assert result["acknowledged"] > 0, result
    for phase in ("after_split", "after_merge"):
        found = result[phase]
        assert not found["not_by_id"] and not found["not_by_search"], (phase, found)
        assert found["live_documents"] == found["expected_documents"], (phase, found)  # none held twice
    for partition, (encoded, puts) in result["encoded_vs_puts"].items():
        assert 0 <= encoded <= puts, f"partition {partition} encoded {encoded} documents for {puts} writes"
    for phase in ("split", "merge"):
        assert any(line == "documents encoded: 0" for line in result[phase]), result[phase]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=Path, help="a build of 2 partitions (default: the sample corpus, built)")
    parser.add_argument("--searches", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of writes around the reshards")
    parser.add_argument("--scenarios", default="replica-kill,split-merge")
    parser.add_argument("--quick", action="store_true", help="300 searches, 6 s of writes")
    parser.add_argument("--work", type=Path, help="keep logs and volumes here (default: a temporary directory)")
    args = parser.parse_args(argv)
    searches, seconds = (300, 6.0) if args.quick else (args.searches, args.seconds)
    results = []
    with contextlib.ExitStack() as stack:
        tmp = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="espn-soak-")))
        tmp.mkdir(parents=True, exist_ok=True)
        parts = args.parts or _sample_parts(tmp)
        store = Store("espn-partitions")
        try:
            for name in args.scenarios.split(","):
                cluster = Cluster(store, tmp / name)
                (tmp / name).mkdir(exist_ok=True)
                try:
                    results.append(replica_kill(cluster, parts, tmp / name, searches) if name == "replica-kill"
                                   else split_and_merge(cluster, parts, tmp / name, seconds))
                finally:
                    cluster.stop()
        finally:
            store.stop()
    rows = [[r["scenario"], r.get("searches", r.get("acknowledged")), r.get("failed", "-"),
             len(r.get("rankings_differ", [])), json.dumps(r.get("encoded_vs_puts", {}))] for r in results]
    print(markdown_table(["scenario", "searches / writes", "failed", "rankings differ", "encoded, puts"], rows))
    write_results("soak_partitions", {"machine": machine(), "results": results})
    failed = 0
    for result in results:
        try:
            check(result)
        except AssertionError as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def _sample_parts(tmp: Path) -> Path:
    out = tmp / "sample-parts"
    subprocess.run([ESPN, "index", str(SAMPLE), "--out", str(out), "--partitions", "2", "--no-progress"], check=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
