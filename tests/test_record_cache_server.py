"""The record cache in a real `espn serve --workers 2 --ram-mib N` (under `ulimit -n 1024`): one
segment both workers map, the RAM split in /readyz and /metrics, and what the cache holds across
a replace, a delete, a compaction and restarts (a clean stop and a SIGKILL).

What the workers cache is read from their shared segment in /dev/shm (`segment_documents`);
every answer is compared with an in-process Searcher that has no cache, on the same generation.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from helpers import run_espn, wait_until

from espn import Searcher
from espn.generation.segments import open_view
from espn.store.cache_segment import SEGMENT_PREFIX, SHM_DIR
from espn.store.ram_plan import plan_ram
from espn.store.record_cache import segment_documents
from server_fixtures import HTTP, running_server

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm: the workers cannot share a cache")

API_KEY = "record-cache-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUERIES = ["protein folding", "vaccine trial results", "climate change effects", "neural networks"]


@pytest.fixture(scope="module")
def served(sample_index: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("record-cache")
    index = root / "index"
    shutil.copytree(sample_index, index)
    plan = plan_ram(index)
    ram_mib = (plan.resident_bytes + 1.2 * plan.table_bytes) / 2**20 + 2  # room for every record
    flags = ("--workers", "2", "--ram-mib", f"{ram_mib:.2f}", "--batch-wait-ms", "0")
    env = {"ESPN_API_KEY": API_KEY, "ESPN_COMPACT_MAX_SEGMENTS": "64"}  # compaction only when the test asks
    return index, root, flags, env


def readiness(server) -> dict:
    """/readyz of whichever worker answers (a worker still warming says 503, with its reader), asked
    with the key: without it /readyz tells only ready or not."""
    response = HTTP.get(f"{server.base_url}/readyz", headers=AUTH, timeout=60)
    assert response.status_code in (200, 503) and "reader" in response.json(), response.text
    return response.json()


def segment_of(server) -> Path:
    """The segment the workers map (each answers /readyz alike; several calls reach both)."""
    paths = {readiness(server)["reader"]["record_cache"]["segment"] for _ in range(4)}
    assert len(paths) == 1 and None not in paths, paths
    return Path(paths.pop())


def search(server, query: str, k: int = 10) -> list[tuple[str, float]]:
    response = HTTP.post(f"{server.base_url}/v1/search", json={"query": query, "k": k}, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return [(hit["id"], hit["score"]) for hit in response.json()["results"]]


def search_all(server, times: int = 3) -> dict[str, list[tuple[str, float]]]:
    """Every query `times` times over fresh connections (both workers answer); the last answers."""
    out = {}
    for _ in range(times):
        for query in QUERIES:
            out[query] = search(server, query)
    return out


def assert_as_without_cache(index: Path, answers: dict[str, list[tuple[str, float]]]) -> None:
    with Searcher.open(index, reader="posix") as reference:
        for query, got in answers.items():
            want = [(hit.doc_id, hit.score) for hit in reference.search([query], k=10)[0].hits]
            assert [i for i, _ in got] == [i for i, _ in want], query
            np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-4)


def doc_number(index: Path, doc_id: str) -> int:
    view = open_view(index, verify="none")
    try:
        return int(view.ids.internal(doc_id))
    finally:
        view.close()


def test_workers_share_one_cache_whose_contents_follow_writes_and_compaction(served) -> None:
    index, root, flags, env = served
    with running_server(index, root, *flags, env=env, name="cache", fd_limit=1024) as server:
        segment = segment_of(server)
        assert segment.parent == SHM_DIR and segment.name.startswith(SEGMENT_PREFIX)
        ram = readiness(server)["reader"]["ram"]
        assert ram["record_cache_bytes"] > ram["table_bytes"] and ram["resident_bytes"] > 0
        metrics = HTTP.get(f"{server.base_url}/metrics", timeout=60).text
        answers = search_all(server)
        assert_as_without_cache(index, answers)
        held = segment_documents(segment)
        assert len(held) > 0
        metrics = HTTP.get(f"{server.base_url}/metrics", timeout=60).text
        assert re.search(r'^espn_ram_bytes\{part="record_cache"\} [1-9]', metrics, re.M), metrics[-3000:]
        assert re.search(r"^espn_record_cache_entries [1-9]", metrics, re.M)

        # A replace: the old version's record leaves the cache once a search sees the new generation.
        replaced = answers[QUERIES[0]][0][0]
        old = doc_number(index, replaced)
        assert old in held
        put = HTTP.put(f"{server.base_url}/v1/documents/{replaced}", json={"text": "a recipe for lemon cake"},
                       headers=AUTH, timeout=120)
        assert put.status_code in (200, 201), put.text
        answers = search_all(server)
        assert old not in segment_documents(segment) and doc_number(index, replaced) != old
        assert_as_without_cache(index, answers)

        # A delete: its record leaves the cache, it leaves the answers.
        deleted = next(i for i, _ in answers[QUERIES[1]] if doc_number(index, i) in segment_documents(segment))
        gone = doc_number(index, deleted)
        assert HTTP.delete(f"{server.base_url}/v1/documents/{deleted}", headers=AUTH, timeout=120).status_code == 200
        answers = search_all(server)
        assert gone not in segment_documents(segment)
        assert all(deleted not in [i for i, _ in hits] for hits in answers.values())
        assert_as_without_cache(index, answers)

        # A compaction rewrites the base: a new segment for the new file, the old one removed once unused.
        run_espn("compact", index)
        wait_until(lambda: search_all(server, times=1) and segment_of(server) != segment,
                   "the workers to serve the rewritten base", timeout_s=120, interval_s=1)
        answers = search_all(server)
        assert_as_without_cache(index, answers)
        wait_until(lambda: not segment.exists(), f"{segment} to be removed", timeout_s=120, interval_s=1)
        segment = segment_of(server)
        assert len(segment_documents(segment)) > 0
        key = segment.name[len(SEGMENT_PREFIX):].rsplit("-", 1)[0]
    assert not list(SHM_DIR.glob(f"{SEGMENT_PREFIX}{key}-*")), "a stopped server leaves no segment"


def test_idle_workers_let_go_of_the_cache_of_a_compacted_base(served) -> None:
    """No request reaches the workers after a compaction: each still moves to the new base on its
    own (the idle refresh) and the old base's segment goes, not at the next request."""
    index, root, flags, env = served
    with running_server(index, root, *flags, env=env, name="idle", fd_limit=1024) as server:
        search_all(server, times=1)
        segment = segment_of(server)
        put = HTTP.put(f"{server.base_url}/v1/documents/idle-doc", json={"text": "a note on tides"}, headers=AUTH,
                       timeout=120)
        assert put.status_code in (200, 201), put.text
        run_espn("compact", index)
        wait_until(lambda: not segment.exists(), f"{segment} to be removed with no request", timeout_s=120,
                   interval_s=0.5)
        assert segment_of(server) != segment


def test_a_restart_after_sigkill_starts_a_fresh_cache_and_removes_the_dead_one(served) -> None:
    index, root, flags, env = served
    with running_server(index, root, *flags, env=env, name="killed", fd_limit=1024) as server:
        search_all(server, times=1)
        dead = segment_of(server)
        assert len(segment_documents(dead)) > 0
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(30)
    assert dead.exists(), "a killed server cannot remove its segment"
    with running_server(index, root, *flags, env=env, name="restarted", fd_limit=1024) as server:
        answers = search_all(server)
        fresh = segment_of(server)
        assert fresh != dead and not dead.exists(), "the new server's first cache removed the dead one"
        assert_as_without_cache(index, answers)


def test_a_ram_below_what_the_index_keeps_resident_stops_serve_with_one_line(served) -> None:
    import subprocess

    from server_fixtures import serve_command

    index, _, _, _ = served
    done = subprocess.run(serve_command(index, "--ram-mib", "0.01", "--port", "0"), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "ram_mib=0.01 is below the" in lines[0] and "keeps resident" in lines[0], done.stderr
