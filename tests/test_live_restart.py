"""A written index served again: real `espn serve` processes restarted after a PUT, a delete
and a compaction, and after a `kill -9` in the middle of each (tests/crash_serve.py is the
real server with the writer's crash hook set), finally from a read-only mount.

One index goes through every phase in order, as an operator's index would: each restart
checks that every acknowledged write is there, that nothing unacknowledged is half there,
and that the server serves (search, fetch, /readyz) the newest generation.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from espn.generation.format import read_current
from espn.generation.segments import open_view
from helpers import run_espn, wait_until
from server_fixtures import HTTP, ServerProcess, running_server

CRASH_SERVE = [sys.executable, str(Path(__file__).with_name("crash_serve.py"))]
# Past two deltas, two are merged in the background (the third write triggers a compaction).
ENV = {"ESPN_COMPACT_MAX_SEGMENTS": "2", "ESPN_COMPACT_MERGE_FACTOR": "2"}


@contextlib.contextmanager
def _server(index: Path, logs: Path, name: str, crash_at: str | None = None, *flags: str) -> Iterator[ServerProcess]:
    env = dict(ENV, ESPN_TEST_CRASH_AT=crash_at) if crash_at else ENV
    with running_server(index, logs, "--no-warmup", *flags, env=env, name=name,
                        espn=CRASH_SERVE if crash_at else ()) as server:
        yield server


def _put(server: ServerProcess, doc_id: str, text: str) -> httpx.Response:
    return HTTP.put(f"{server.base_url}/v1/documents/{doc_id}", json={"text": text}, timeout=120)


def _killed(server: ServerProcess, request) -> None:  # noqa: ANN001 - a callable making the fatal request
    """The request that reaches the crash step gets no answer, and the server died of SIGKILL."""
    with pytest.raises(httpx.TransportError):
        request()
    assert server.process.wait(60) == -signal.SIGKILL


def _served(server: ServerProcess, present: list[str], absent: list[str], top: dict[str, str]) -> int:
    """Every id in `present` is fetched, none in `absent`; each query's top hit is as given."""
    for doc_id in present:
        assert HTTP.get(f"{server.base_url}/v1/documents/{doc_id}", timeout=60).status_code == 200, doc_id
    for doc_id in absent:
        assert HTTP.get(f"{server.base_url}/v1/documents/{doc_id}", timeout=60).status_code == 404, doc_id
    for query, doc_id in top.items():
        response = HTTP.post(f"{server.base_url}/v1/search", json={"query": query, "k": 3}, timeout=60)
        assert response.status_code == 200 and response.json()["results"][0]["id"] == doc_id, (query, response.text)
    ready = HTTP.get(f"{server.base_url}/readyz").json()
    assert ready["status"] == "ready"
    return int(ready["generation"])


@pytest.mark.slow
def test_a_written_index_is_served_again_after_restarts_and_kill_9(sample_index: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    shutil.copytree(sample_index, index)
    logs = tmp_path / "logs"
    logs.mkdir()
    elephant, volcano = "a purple elephant dancing on the moon", "lava flows from an erupting volcano tonight"
    # 1. kill -9 in the middle of a PUT: its records appended, its segment in place, nothing published.
    with _server(index, logs, "put", "segment:2") as server:
        assert _put(server, "p-1", elephant).status_code == 201
        _killed(server, lambda: _put(server, "p-2", volcano))
    # 2. Restarted after the PUT and the kill: p-1 there, p-2 not. Then kill -9 in the middle of a delete.
    with _server(index, logs, "delete", "tombstones:2") as server:
        assert _served(server, ["p-1"], ["p-2"], {elephant: "p-1"}) == 1
        assert HTTP.delete(f"{server.base_url}/v1/documents/s0001", timeout=60).status_code == 200
        _killed(server, lambda: HTTP.delete(f"{server.base_url}/v1/documents/s0002", timeout=60))
    # 3. Restarted after the delete: then writes trigger a merge (it completes), and more writes
    #    a second one, killed in its swap after the merged delta was renamed into place.
    with _server(index, logs, "compaction", "swap-renamed:2") as server:
        assert _served(server, ["p-1", "s0002"], ["p-2", "s0001"], {elephant: "p-1"}) == 2
        for i in range(2):
            assert _put(server, f"c-{i}", f"compaction probe {i}: a zebra playing chess").status_code == 201
        wait_until(lambda: len(read_current(index).segments) <= 2, "the compaction", interval_s=0.3)
        merged = read_current(index)
        assert _put(server, "c-2", volcano).status_code == 201  # acknowledged; its compaction is killed
        assert server.process.wait(60) == -signal.SIGKILL
    assert read_current(index).number == merged.number + 1  # c-2 published, the second merge not
    # 4. A base rewrite by `espn compact` (its first writer recovers what the killed one left),
    #    then a restart on a read-only mount: everything acknowledged is served, writes get 409.
    run_espn("compact", index)
    rewritten = read_current(index)
    assert rewritten.base.startswith("live/base-") and not rewritten.segments and not rewritten.tombstones
    view = open_view(index, verify="full")  # what a restart opens verifies in full
    view.close()
    assert not [p.name for p in (index / "live").iterdir() if p.name.startswith("stage-") or p.name.endswith(".tmp")]
    _serve_read_only(index, logs, rewritten.number, elephant, volcano)


def _serve_read_only(index: Path, logs: Path, generation: int, elephant: str, volcano: str) -> None:
    """On a read-only bind mount (a mount namespace of its own), `espn serve` finds out by itself;
    where this sandbox cannot mount, `--read-only` says it instead."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {index} {index} && "
                            f"mount -o remount,ro,bind {index}"], capture_output=True)
    if probe.returncode == 0:
        espn, flags = (["unshare", "-m", "sh", "-c", f'mount --bind {index} {index} && '
                        f'mount -o remount,ro,bind {index} && exec "$@"', "sh", str(Path(sys.executable).parent / "espn")],
                       ())
    else:
        espn, flags = (), ("--read-only",)
    with running_server(index, logs, "--no-warmup", *flags, name="read-only", espn=espn) as server:
        assert _served(server, ["p-1", "s0002", "c-0", "c-1", "c-2"], ["p-2", "s0001"],
                       {elephant: "p-1", volcano: "c-2"}) == generation
        assert HTTP.get(f"{server.base_url}/readyz").json()["mode"] == "read-only"
        for method, path, body in [("PUT", "/v1/documents/x", {"text": "refused"}), ("DELETE", "/v1/documents/p-1", None),
                                   ("POST", "/v1/documents/batch", {"delete": ["p-1"]})]:
            response = HTTP.request(method, f"{server.base_url}{path}", json=body, timeout=60)
            assert response.status_code == 409, response.text
            assert response.json()["error"] == "read_only" and "read-only" in response.json()["message"]
        if not flags:
            events = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
            said = [e for e in events if e.get("event") == "read_only"]
            assert len(said) == 1 and "read-only filesystem" in said[0]["message"]
    assert read_current(index).number == generation
