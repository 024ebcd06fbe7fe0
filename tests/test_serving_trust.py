"""The serving path trusts nothing from outside and leaves nothing behind (issue 44, part 5).

Real `espn serve` processes on loopback ports: a body nested 1,000 or 100,000 deep is a 400
on every JSON route (never a 500); a server killed with SIGKILL leaves no metric directory
once the next one starts, and a stopped one no staging directory in its index; a generation
that fails to open is retried on a back-off and logged once; an internal error inside a batch
fails the request visibly instead of passing for a bad query; a compaction running at
shutdown finishes before the process exits. Plus the pieces without a server: the library's
per-query isolation, LiveSearcher's back-off and the metric directories' sweep.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from espn.errors import InvalidParameterError
from espn.generation.format import read_current
from espn.search.isolation import search_each
from espn_server.metrics_dir import MetricsDir, remove_stale
from helpers import wait_until
from server_fixtures import HTTP, running_server

API_KEY = "serving-trust-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FAULT_SERVE = [sys.executable, str(Path(__file__).with_name("fault_serve.py"))]


@pytest.fixture
def index(sample_index: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "index"
    shutil.copytree(sample_index, copy)
    return copy


def _json_lines(log: str) -> list[dict[str, Any]]:
    out = []
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _stage_dirs(index: Path) -> list[str]:
    live = index / "live"
    return sorted(p.name for p in live.iterdir() if p.name.startswith("stage-")) if live.is_dir() else []


# -- 5. one depth rule for every JSON body ----------------------------------------------

def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


ROUTES = [("POST", "/v1/search"), ("POST", "/v1/search/batch"), ("PUT", "/v1/documents/deep-1"),
          ("POST", "/v1/documents/batch"), ("POST", "/v1/snapshots")]


def test_a_body_nested_deeper_than_the_rule_is_a_400_on_every_json_route(index: Path, tmp_path: Path) -> None:
    with running_server(index, tmp_path, "--no-warmup", "--snapshot-dir", str(tmp_path / "snapshots"),
                        env={"ESPN_API_KEY": API_KEY}) as server:
        bodies = {f"array {depth}": _nested(depth) for depth in (1_000, 100_000)}
        # A request that is otherwise valid, with the depth in a field: the search fast path parses these.
        bodies["search with a deep filter"] = b'{"query": "vaccines", "filter": ' + _nested(1_000) + b"}"
        bodies["document with deep metadata"] = b'{"text": "x", "metadata": {"a": ' + _nested(5_000) + b"}}"
        for name, body in bodies.items():
            for method, path in ROUTES:
                for headers in ({"Content-Type": "application/json"}, {}):  # the rule holds whatever the type
                    response = HTTP.request(method, f"{server.base_url}{path}", content=body,
                                            headers={**AUTH, **headers}, timeout=60)
                    assert response.status_code == 400, (name, method, path, response.status_code, response.text)
                    error = response.json()
                    assert error["error"] == "malformed_json", error
                    assert re.search(r"nested \d+ levels deep \(at most 64\)", error["message"]), error
        # Within the rule, the routes answer as before.
        ok = HTTP.post(f"{server.base_url}/v1/search", json={"query": "vaccines", "k": 3}, headers=AUTH, timeout=60)
        assert ok.status_code == 200, ok.text
        shallow = HTTP.post(f"{server.base_url}/v1/search", content=_nested(10),
                            headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
        assert shallow.status_code == 422, shallow.text  # valid JSON, not a SearchRequest
        assert "Traceback" not in server.log() and "RecursionError" not in server.log()


# -- 8. nothing left behind ------------------------------------------------------------

def test_kill_9_of_a_two_worker_server_leaves_no_metrics_dir_once_the_next_one_starts(
        index: Path, tmp_path: Path) -> None:
    private = tmp_path / "tmp"
    private.mkdir()
    env = {"TMPDIR": str(private), "ESPN_API_KEY": API_KEY}

    def metric_dirs() -> list[Path]:
        return sorted(p for p in private.iterdir() if p.name.startswith("espn-metrics-"))

    with running_server(index, tmp_path, "--workers", "2", "--no-warmup", env=env, name="first") as first:
        (dead,) = metric_dirs()
        assert dead.name.startswith(f"espn-metrics-{first.pid}-")
        os.killpg(first.pid, signal.SIGKILL)  # the server and its workers, as the OOM killer or `kill -9` would
        first.process.wait(30)
        wait_until(lambda: not _group_alive(first.pid), "the killed server's workers to go", timeout_s=30)
    assert metric_dirs() == [dead]  # nobody could remove it
    with running_server(index, tmp_path, "--workers", "2", "--no-warmup", env=env, name="second") as second:
        (live,) = metric_dirs()
        assert live != dead and live.name.startswith(f"espn-metrics-{second.pid}-")
        log = second.log()
    assert metric_dirs() == []  # a graceful stop removes its own
    assert any(line.get("event") == "stale metric directories removed" and str(dead) in line.get("paths", [])
               for line in _json_lines(log)), log[-3000:]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_only_metric_directories_of_gone_servers_are_removed(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"espn-metrics-{gone.pid}-abc123"
    stale.mkdir()
    (stale / "counter_1.db").write_bytes(b"x")
    alive = tmp_path / f"espn-metrics-{os.getppid()}-def456"  # a running process's
    alive.mkdir()
    other = tmp_path / "espn-metrics-notapid"  # not a name espn makes
    other.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / f"espn-metrics-{gone.pid}-link01"  # a link is never followed
    link.symlink_to(target)
    held = MetricsDir(tmp_path)  # this process's own, locked
    # A dead pid whose lock is held (an owner in another pid namespace): kept.
    foreign = tmp_path / f"espn-metrics-{gone.pid}-ghi789"
    foreign.mkdir()
    fd = os.open(foreign, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert remove_stale(tmp_path) == [stale]
    finally:
        os.close(fd)
    assert alive.is_dir() and other.is_dir() and target.is_dir() and link.is_symlink() and held.path.is_dir()
    assert remove_stale(tmp_path) == [foreign]  # its lock is free now
    held.close()
    assert not held.path.exists()


def test_a_stopped_server_leaves_no_staging_directory_and_the_next_start_removes_an_old_one(
        index: Path, tmp_path: Path) -> None:
    (index / "live").mkdir(exist_ok=True)
    left = index / "live" / "stage-text-left0ver"  # what an older server left (no one holds its lock)
    (left / "work").mkdir(parents=True)
    with running_server(index, tmp_path, env={"ESPN_API_KEY": API_KEY}) as server:
        wait_until(lambda: not left.exists(), "the old staging directory to go at start", timeout_s=60)
        put = HTTP.put(f"{server.base_url}/v1/documents/trust-1", json={"text": "A purple elephant on the moon."},
                       headers=AUTH, timeout=120)
        assert put.status_code == 201, put.text
        assert [name for name in _stage_dirs(index) if name.startswith("stage-text-")]  # the text side's work dir
        assert server.terminate() == 0
    assert _stage_dirs(index) == []
    assert read_current(index).number >= 1


# -- a generation that fails to open --------------------------------------------------

FAILED = "could not open the newest generation"


def test_a_generation_that_fails_to_open_is_retried_on_a_back_off_and_logged_once(index: Path, tmp_path: Path) -> None:
    with running_server(index, tmp_path, "--no-warmup", env={"ESPN_API_KEY": API_KEY}) as server:
        url = f"{server.base_url}/v1/search"
        put = HTTP.put(f"{server.base_url}/v1/documents/trust-2", json={"text": "A purple elephant on the moon."},
                       headers=AUTH, timeout=120)
        assert put.status_code == 201, put.text
        live = index / "live"
        published = json.loads((live / (live / "CURRENT").read_text().strip()).read_text())
        # A record that does not parse, published as the newest generation.
        (live / "gen-000099.json").write_text("{ not json")
        _replace(live / "CURRENT", "gen-000099.json\n")
        for _ in range(30):  # over a second or more: retries on the back-off fail meanwhile, silently
            response = HTTP.post(url, json={"query": "purple elephant on the moon", "k": 3}, headers=AUTH, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["results"][0]["id"] == "trust-2"  # still the generation it served
        log = server.log()
        assert log.count(FAILED) == 1, log[-4000:]
        assert log.count("Traceback") == 1
        # The record repaired in place (live/CURRENT unchanged): only a retry on the back-off can open it.
        _replace(live / "gen-000099.json", json.dumps({**published, "generation": 99}))

        def reopened() -> bool:
            HTTP.post(url, json={"query": "purple elephant", "k": 3}, headers=AUTH, timeout=60)
            return "serving generation 99" in server.log()

        wait_until(reopened, "the generation to open on a retry", timeout_s=60, interval_s=0.5)
        log = server.log()
        assert log.count(FAILED) == 1 and "the newest generation opened after" in log, log[-4000:]


def _replace(path: Path, text: str) -> None:
    """As a writer publishes: a new file renamed over the old (a new inode, so a new token)."""
    tmp = path.with_name(path.name + ".test")
    tmp.write_text(text)
    os.replace(tmp, path)


class _FakeSearcher:
    """What LiveSearcher asks of a Searcher: refresh, published_token, generation, close."""

    def __init__(self, generation: int, world: dict[str, Any]) -> None:
        self.generation, self.world = generation, world

    def published_token(self) -> tuple[int, int]:
        return self.world["token"]

    def refresh(self) -> "_FakeSearcher | None":
        self.world["opens"] += 1
        if self.world["broken"]:
            raise ValueError("cannot open the generation")
        return _FakeSearcher(self.generation + 1, self.world)

    def close(self) -> None:
        pass


def test_live_searcher_retries_a_failed_generation_on_a_capped_back_off(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    import espn.search.live_searcher as lease

    clock = [1000.0]
    monkeypatch.setattr(lease.time, "monotonic", lambda: clock[0])
    world: dict[str, Any] = {"token": (1, 1), "opens": 0, "broken": True}
    live = lease.LiveSearcher(_FakeSearcher(0, world))  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="espn.search.live_searcher"):
        for _ in range(100):  # a hundred requests: one open tried, one error logged
            assert live.refresh() is False
        assert world["opens"] == 1
        waits = []
        for _ in range(10):  # each failed retry doubles the wait, up to RETRY_MAX_S
            before = world["opens"]
            step = 0.0
            while world["opens"] == before:
                step += 0.25
                clock[0] += 0.25
                live.refresh()
            waits.append(step)
        assert waits[0] == pytest.approx(lease.RETRY_FIRST_S, abs=0.25)
        assert waits[1] == pytest.approx(2 * lease.RETRY_FIRST_S, abs=0.25)
        assert max(waits) == pytest.approx(lease.RETRY_MAX_S, abs=0.25)
        errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(errors) == 1 and errors[0].exc_info is not None
        world["token"] = (2, 2)  # a newer generation is published: tried at once
        opens = world["opens"]
        live.refresh()
        assert world["opens"] == opens + 1
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 2  # a new failure: logged
        world["broken"] = False
        clock[0] += lease.RETRY_MAX_S
        assert live.refresh() is True
        assert live.current.generation == 1
        assert any("opened after" in r.getMessage() for r in caplog.records)
        assert live.refresh() is True  # no failure remembered: every refresh tries (here, always newer)
    live.close()


# -- an internal error inside a batch ------------------------------------------------

def test_an_internal_error_inside_a_batch_is_that_querys_internal_error_not_a_bad_query(
        index: Path, tmp_path: Path) -> None:
    armed = tmp_path / "bug-armed"
    with running_server(index, tmp_path, "--no-warmup", "--reader", "posix", espn=FAULT_SERVE,
                        env={"ESPN_API_KEY": API_KEY, "ESPN_TEST_BUG_FILE": str(armed)}) as server:
        batch = {"queries": ["vaccines and the immune system", "ocean temperature", "protein folding"], "k": 3}
        fine = HTTP.post(f"{server.base_url}/v1/search/batch", json=batch, headers=AUTH, timeout=60)
        assert fine.status_code == 200 and not fine.json()["errors"], fine.text
        armed.touch()  # from now on every read of the store raises a plain ValueError (a bug)
        broken = HTTP.post(f"{server.base_url}/v1/search/batch", json=batch, headers=AUTH, timeout=60)
        # Visible as what it is (never "invalid_query"), each query's own entry (never the batch's 500),
        # and nothing internal reaches the client.
        assert broken.status_code == 200, broken.text
        assert [(e["index"], e["error"]) for e in broken.json()["errors"]] == [(0, "internal_error"), (1, "internal_error"),
                                                                            (2, "internal_error")]
        assert "invalid_query" not in broken.text and "injected" not in broken.text
        single = HTTP.post(f"{server.base_url}/v1/search", json={"query": "ocean temperature"}, headers=AUTH,
                           timeout=60)
        assert single.status_code == 500, single.text
        log = server.log()
        assert "injected internal error" in log and "Traceback" in log  # visible to the operator
        armed.unlink()
        again = HTTP.post(f"{server.base_url}/v1/search/batch", json=batch, headers=AUTH, timeout=60)
        assert again.status_code == 200 and not again.json()["errors"], again.text


def test_search_each_isolates_refusals_only() -> None:
    calls: list[list[int]] = []

    def run(rows: list[int]) -> list[str]:
        calls.append(rows)
        if 1 in rows:
            raise InvalidParameterError("query 1 has no text")
        return [f"r{r}" for r in rows]

    outcomes = search_each(run, 3)
    assert outcomes[0] == "r0" and outcomes[2] == "r2" and isinstance(outcomes[1], InvalidParameterError)
    assert calls == [[0, 1, 2], [0], [1], [2]]
    assert search_each(lambda rows: [f"r{r}" for r in rows], 2) == ["r0", "r1"]

    def buggy(rows: list[int]) -> list[str]:
        raise ValueError("an internal bug")  # not a refusal: never a query's fault

    with pytest.raises(ValueError, match="internal bug"):
        search_each(buggy, 3)
    seen: list[int] = []

    def strict(row: int, refused: InvalidParameterError) -> None:
        seen.append(row)
        raise InvalidParameterError(f"query {row}: {refused}")

    with pytest.raises(InvalidParameterError, match="query 1: query 1 has no text"):
        search_each(run, 3, on_refusal=strict)
    assert seen == [1]


# -- the compaction thread at shutdown --------------------------------------------------

def test_a_compaction_running_at_shutdown_finishes_before_the_server_exits(index: Path, tmp_path: Path) -> None:
    paused = tmp_path / "compaction-paused"
    env = {"ESPN_API_KEY": API_KEY, "ESPN_COMPACT_BASE_RATIO": "0.001",  # one written document asks for a rewrite
           "ESPN_TEST_PAUSE_AT": f"compact-staged:3:{paused}"}
    with running_server(index, tmp_path, "--no-warmup", espn=FAULT_SERVE, env=env) as server:
        before = read_current(index)
        put = HTTP.put(f"{server.base_url}/v1/documents/trust-3", json={"text": "Compacted at shutdown."},
                       headers=AUTH, timeout=120)
        assert put.status_code == 201, put.text
        wait_until(paused.exists, "the compaction to reach its pause", timeout_s=120)
        assert server.terminate(timeout=120) == 0  # SIGTERM while the compaction sleeps in its thread
        log = server.log_path.read_text(errors="replace")
    after = read_current(index)
    assert after.base != before.base and not after.segments, after  # the rewrite was swapped in
    assert "Traceback" not in log, log[-4000:]
    messages = [line.get("msg") for line in _json_lines(log)]
    assert "waiting for the running compaction to finish" in messages, messages
    assert messages.index("waiting for the running compaction to finish") < messages.index("index closed")
    assert _stage_dirs(index) == []
