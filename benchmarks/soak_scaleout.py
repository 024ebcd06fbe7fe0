"""Fenced writers under failure, with real processes and a real S3-compatible store (moto's,
versioned): two `espn serve --publish` writers started at once for one partition while 4 clients
write to whichever takes writes, through three phases:

1. both running: one leads, the other stands by and refuses writes (`writer_standby`);
2. the leader paused (SIGSTOP) past its lease: the standby takes over and writes go on through
   it; the paused one resumed (SIGCONT) answers `writer_superseded` and follows;
3. the new leader killed with SIGKILL in the middle of a blob upload (its crash point armed,
   tests/crash_serve.py): the other takes over; the killed one restarted stands by.

Checked at the end: a fresh restore of the newest published generation holds every
acknowledged id (read by id), every generation record on the store has exactly one version,
and each writer said what it was. Printed: writes acknowledged, refusals by code, and the
write latency (p50/p99) the clients saw, failovers included.

    python -m benchmarks.soak_scaleout --seconds 60      # the soak: 60 s of writes in all
    python -m benchmarks.soak_scaleout --quick           # 9 s

tests/test_fenced_writers.py runs the same sequence short.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, machine, markdown_table, percentiles, write_results
from benchmarks.scaleout import (ESPN, HTTP, Clients, Cluster, Proc, Store, missing_after_restore, paused,
                                 wait_for)

__all__ = ["failover_sequence", "check", "main"]

SAMPLE = ROOT / "espn" / "data" / "sample_corpus.jsonl"


def _role(writer: Proc) -> dict[str, Any]:
    return writer.readyz().get("replication") or {}


def _leader(writers: list[Proc], timeout_s: float = 120.0) -> Proc:
    found: list[Proc] = []

    def one_leads() -> bool:
        found[:] = [w for w in writers if w.alive() and _role(w).get("role") == "leader"]
        return len(found) == 1

    wait_for(one_leads, "one writer to lead", timeout_s)
    return found[0]


def failover_sequence(cluster: Cluster, base: Path, tmp: Path, seconds: float, lease_s: float) -> dict[str, Any]:
    """The three phases above, `seconds` of writes in all; the result `check` reads."""
    prefix = "failover"
    url = cluster.store.url(prefix)
    names = ("wa", "wb")
    arm = {name: tmp / f"arm-{name}" for name in names}
    volumes = {name: tmp / prefix / name for name in names}
    for volume in volumes.values():
        shutil.copytree(base, volume)
    started = {name: cluster.writer(name, volumes[name], url, lease_s=lease_s, crash_at="uploaded:3",
                                    armed_by=arm[name]) for name in names}
    writers = list(started.values())
    for writer in writers:
        writer.wait_ready()
    events: dict[str, Any] = {}
    clients = Clients(lambda: [w.base_url for w in writers], prefix="c").start(4)
    try:
        time.sleep(seconds / 3)  # 1. both running
        first = _leader(writers)
        second = [w for w in writers if w is not first][0]
        events["standby_role"] = _role(second).get("role")
        events["acked_before_failover"] = dict(clients.by_writer)
        with paused(first):  # 2. the leader paused past its lease
            wait_for(lambda: _role(second).get("role") == "leader", "the standby to take over", 10 * lease_s)
            time.sleep(max(lease_s, seconds / 6))
        wait_for(lambda: _role(first).get("superseded") is not None, "the resumed writer to know it lost", 10 * lease_s)
        late = HTTP.put(f"{first.base_url}/v1/documents/late-0", json={"text": "to the superseded writer"}, timeout=30)
        events["superseded_answer"] = [late.status_code, late.json().get("error")]
        time.sleep(seconds / 6)
        arm[second.name].touch()  # 3. the new leader dies at its 3rd upload from now: mid-publish
        wait_for(lambda: not second.alive(), "the leader to die mid-upload", 120)
        events["killed_returncode"] = second.process.returncode
        wait_for(lambda: _role(first).get("role") == "leader", "the other writer to take over", 10 * lease_s + 30)
        arm[second.name].unlink()
        again = cluster.writer(second.name, volumes[second.name], url, lease_s=lease_s, port=second.port)
        writers[writers.index(second)] = again
        again.wait_ready()
        time.sleep(seconds / 6)
        events["restarted_role"] = _role(again).get("role")
    finally:
        clients.stop()
    missing = missing_after_restore(url, clients.acked, tmp / "restored")
    latency = percentiles([t * 1000 for t in clients.latencies]) if clients.latencies else {}
    return {"seconds": seconds, "acknowledged": len(clients.acked), "missing": missing,
            "overwritten_records": cluster.store.overwritten_records(prefix), "by_writer": clients.by_writer,
            "refusals": clients.refusals, "latency_ms": latency, **events}


def check(result: dict[str, Any]) -> None:
    """AssertionError naming what the run broke."""
    assert result["acknowledged"] > 0, f"no write was acknowledged ({result['refusals']})"
    assert not result["missing"], f"acknowledged but not published: {result['missing'][:20]}"
    assert not result["overwritten_records"], f"generation records overwritten: {result['overwritten_records']}"
    assert result["standby_role"] == "standby" and len(result["acked_before_failover"]) == 1, result
    assert result["superseded_answer"] == [503, "writer_superseded"], result
    assert result["killed_returncode"] == -signal.SIGKILL and result["restarted_role"] == "standby", result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", type=Path, help="the index each writer starts from (default: the sample corpus, built)")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of writes in all")
    parser.add_argument("--lease-s", type=float, default=4.0)
    parser.add_argument("--quick", action="store_true", help="9 s of writes")
    parser.add_argument("--work", type=Path, help="keep the processes' logs and volumes here (default: a temporary directory)")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        tmp = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="espn-soak-")))
        tmp.mkdir(parents=True, exist_ok=True)
        base = args.index or _sample_index(tmp)
        store = Store("espn-soak")
        cluster = Cluster(store, tmp)
        try:
            result = failover_sequence(cluster, base, tmp, 9.0 if args.quick else args.seconds, args.lease_s)
        finally:
            cluster.stop()
            store.stop()
    print(markdown_table(["s", "acknowledged", "missing", "overwritten", "p50 ms", "p99 ms", "refusals"],
                         [[result["seconds"], result["acknowledged"], len(result["missing"]),
                           len(result["overwritten_records"]), result["latency_ms"].get("p50"),
                           result["latency_ms"].get("p99"),
                           ", ".join(f"{k} {v}" for k, v in sorted(result["refusals"].items()))]]))
    write_results("soak_scaleout", {"machine": machine(), "result": result})
    try:
        check(result)
    except AssertionError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    return 0


def _sample_index(tmp: Path) -> Path:
    out = tmp / "sample-index"
    subprocess.run([ESPN, "index", str(SAMPLE), "--out", str(out), "--no-progress"], check=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
