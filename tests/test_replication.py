"""Scale-out end to end, with real processes: a real S3-compatible server (moto's, started by the
test), 2 partitions each with 1 writer (`espn serve --publish`) and 2 followers (`espn serve
--follow`), and `espn route --writers` in front. 500 writes (240 PUTs, 50 batches of 5, 10
deletes) go through the router while one
writer is killed with SIGKILL in the middle of an upload (tests/crash_serve.py) and restarted,
and one follower is killed and restarted from its local copy. At the end every acknowledged
write is on every follower of its partition, and no follower ever served a generation that
was not wholly published."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
from helpers import HTTP_TIMEOUT_S, run_espn, wait_until
from server_fixtures import BIN, HTTP, REPO, ServerProcess, free_port, s3_server

from espn.partitioning import owner

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

SAMPLE_CORPUS = REPO / "espn" / "data" / "sample_corpus.jsonl"
CRASH_SERVE = [sys.executable, str(Path(__file__).with_name("crash_serve.py"))]
BUCKET = "espn-cluster"
PARTITIONS = 2


def _until(check: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    wait_until(check, what, timeout_s, interval_s=0.2, ignore=(httpx.HTTPError,))


class Cluster:
    """The processes of the test, each started in its own session and always stopped."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp, self.env = tmp, env
        self.processes: list[ServerProcess] = []

    def serve(self, name: str, index: Path, *flags: str, espn: list[str] | None = None,
              extra_env: dict[str, str] | None = None, port: int | None = None, wait: bool = True) -> ServerProcess:
        port = port or free_port()
        command = [*(espn or [str(BIN / "espn")]), "serve", str(index), "--host", "127.0.0.1", "--port", str(port),
                   "--workers", "1", "--no-warmup", *flags]
        server = ServerProcess(command, port, self.tmp / f"{name}.log", {**self.env, **(extra_env or {})})
        self.processes.append(server)
        if wait:
            server.wait_ready()
        return server

    def route(self, shards: list[str], writers: list[str]) -> ServerProcess:
        port = free_port()
        command = [str(BIN / "espn"), "route", "--shards", ",".join(shards), "--writers", ",".join(writers),
                   "--port", str(port), "--write-timeout-ms", "20000"]
        router = ServerProcess(command, port, self.tmp / "router.log", self.env)
        self.processes.append(router)
        router.wait_ready()
        return router

    def stop(self) -> None:
        for process in self.processes:
            process.terminate()


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    with s3_server(monkeypatch, BUCKET) as (_, env):
        yield env


@functools.cache
def _s3(endpoint: str) -> Any:
    """One boto3 client per store (making one loads the service model: tens of ms of CPU per poll)."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)


def _records(prefix: str) -> set[int]:
    """Generation numbers with a record on the store (a generation is published once its record is)."""
    listing = _s3(os.environ["AWS_ENDPOINT_URL"]).list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/generations/")
    return {int(item["Key"].rsplit("gen-", 1)[1].split(".")[0]) for item in listing.get("Contents", [])}


def _replication(server: ServerProcess) -> dict[str, Any]:
    return HTTP.get(f"{server.base_url}/readyz").json().get("replication") or {}


@pytest.mark.slow
def test_writes_through_the_router_reach_every_follower_across_crashes(s3_env: dict[str, str], tmp_path: Path,
                                                                       sample_partitions: Path) -> None:
    base_env = {key: value for key, value in os.environ.items() if not key.startswith("ESPN_")}
    base_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    cluster = Cluster(tmp_path, {**base_env, **s3_env})
    prefixes = [f"parts/part-{p}" for p in range(PARTITIONS)]
    urls = [f"s3://{BUCKET}/{prefix}" for prefix in prefixes]
    watching = threading.Event()
    try:
        # Writers, each on its own copy of its partition. Writer 0 kills itself (SIGKILL) after its
        # 40th blob upload: past its first publish (the whole base), in the middle of a later one.
        volumes = [tmp_path / f"writer-{p}" for p in range(PARTITIONS)]
        for p in range(PARTITIONS):
            shutil.copytree(sample_partitions / f"part-{p}", volumes[p])  # built once per run (conftest)
        publish = ["--publish-interval-s", "0.2"]
        writers = [cluster.serve("writer-0", volumes[0], "--publish", urls[0], *publish, espn=CRASH_SERVE,
                                 extra_env={"ESPN_TEST_CRASH_AT": "uploaded:40"}, wait=False),
                   cluster.serve("writer-1", volumes[1], "--publish", urls[1], *publish, wait=False)]
        for server in writers:  # started together, waited for together
            server.wait_ready()
        for prefix in prefixes:
            _until(lambda: bool(_records(prefix)), f"the first publish to {prefix}")
        # Followers start from nothing: each restores the newest generation, then follows.
        follow = ["--follow-interval-s", "0.3"]
        followers = [[cluster.serve(f"follower-{p}-{j}", tmp_path / f"follower-{p}-{j}", "--follow", urls[p], *follow,
                                    wait=False) for j in range(2)] for p in range(PARTITIONS)]
        for server in followers[0] + followers[1]:
            server.wait_ready()
        router = cluster.route([followers[p][0].base_url for p in range(PARTITIONS)], [w.base_url for w in writers])

        # Every follower's generation, watched all along, to check against what was published.
        served: list[tuple[int, int]] = []

        def watch() -> None:
            while not watching.is_set():
                for p in range(PARTITIONS):
                    for follower in followers[p]:
                        with contextlib.suppress(httpx.HTTPError, ValueError):
                            generation = _replication(follower).get("generation")
                            if generation is not None:
                                served.append((p, generation))
                time.sleep(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()

        acknowledged: set[str] = set()
        lock = threading.Lock()

        def send(method: str, path: str, body: Any = None) -> httpx.Response:
            """Retry while the owner's writer is down (503) or slow (504): PUT is safe to repeat."""
            deadline = time.monotonic() + 240
            while True:
                answer = HTTP.request(method, router.base_url + path, json=body, timeout=60)
                if answer.status_code not in (503, 504) or time.monotonic() > deadline:
                    return answer
                time.sleep(float(answer.headers.get("retry-after", "0.5")))

        def write(i: int) -> None:
            if i % 29 in (4, 9, 14, 19, 24):  # 50 batches of 5 upserts, spread over both partitions; 240 PUTs
                ids = [f"w{i}-{j}" for j in range(5)]
                answer = send("POST", "/v1/documents/batch",
                              {"upsert": [{"id": d, "text": f"replicated passage {d} about glaciers",
                                           "metadata": {"kind": "batch"}} for d in ids]})
                assert answer.status_code == 200, answer.text
                assert sorted(answer.json()["applied"]) == sorted({owner(d, PARTITIONS) for d in ids})
                written = ids
            else:
                answer = send("PUT", f"/v1/documents/w{i}", {"text": f"replicated passage w{i} about moraines"})
                assert answer.status_code in (200, 201), answer.text
                written = [f"w{i}"]
            with lock:
                acknowledged.update(written)

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(write, i) for i in range(290)]
            # Writer 0 dies in the middle of an upload. Before it is back, no follower of its
            # partition serves a generation whose record is not on the store.
            _until(lambda: writers[0].process.poll() is not None, "writer 0 to die mid-upload", 180)
            assert writers[0].process.returncode == -signal.SIGKILL, writers[0].log()[-3000:]
            complete = _records(prefixes[0])
            for follower in followers[0]:
                assert _replication(follower)["generation"] in complete
            # Restarted on its volume and its port (the router's --writers names it): writes retried meanwhile go on.
            writers[0] = cluster.serve("writer-0-again", volumes[0], "--publish", urls[0], *publish,
                                       port=writers[0].port)
            # A follower killed with SIGKILL restarts from its local copy and catches up.
            victim = followers[1][1]
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait(30)
            time.sleep(1)
            followers[1][1] = cluster.serve("follower-1-1-again", tmp_path / "follower-1-1", "--follow", urls[1],
                                            *follow, port=victim.port)
            for future in futures:
                future.result()
        gone = sorted(acknowledged)[:10]
        for doc_id in gone:  # the last 10 of the 500 writes: deletes
            assert send("DELETE", f"/v1/documents/{doc_id}").status_code == 200
        assert len(acknowledged) == 240 + 50 * 5  # with the 10 deletes: 500 writes

        # Every follower catches up with what its writer published last ...
        for p in range(PARTITIONS):
            _until(lambda: _replication(writers[p]).get("lag_generations") == 0, f"writer {p} to publish all")
            newest = _replication(writers[p])["generation"]
            for follower in followers[p]:
                _until(lambda: _replication(follower).get("generation") == newest, f"a follower of {p} to catch up")
        watching.set()
        watcher.join(10)
        # ... and holds every acknowledged write, on the partition that owns it.
        with httpx.Client(timeout=HTTP_TIMEOUT_S) as client:
            for doc_id in sorted(acknowledged):
                for follower in followers[owner(doc_id, PARTITIONS)]:
                    status = client.get(f"{follower.base_url}/v1/documents/{doc_id}").status_code
                    assert status == (404 if doc_id in gone else 200), (doc_id, follower.base_url)
            hits = client.post(f"{router.base_url}/v1/search", json={"query": "replicated passage about glaciers",
                                                                      "k": 10}).json()["results"]
            assert {hit["id"] for hit in hits} & acknowledged
            # Combined with filters and explanations, on a follower of each partition: the metadata
            # written through the router replicated with its documents.
            for p in range(PARTITIONS):
                found = client.post(f"{followers[p][1].base_url}/v1/search", json={
                    "query": "replicated passage about glaciers", "k": 5, "filter": {"kind": {"in": ["batch"]}},
                    "explain": True}).json()["results"]
                assert found and all("-" in hit["id"] and owner(hit["id"], PARTITIONS) == p for hit in found)
                assert all(hit["explanation"] for hit in found)
        # No follower ever served a generation that was not wholly published.
        published = [_records(prefix) for prefix in prefixes]
        assert served and all(generation in published[p] for p, generation in served)
    finally:
        watching.set()
        cluster.stop()
    for p in range(PARTITIONS):
        for j in range(2):
            run_espn("verify", tmp_path / f"follower-{p}-{j}")
