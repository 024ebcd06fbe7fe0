"""The build job through the real CLI when it is interrupted or split: kill -9 and resume, a dead
tokenising worker, a full disk, two shard processes merged (the rest: test_build.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from espn.index import IndexDirectory

from helpers import CONTENT_FILES, digest, run_espn, wait_until, write_jsonl


@pytest.mark.slow
def test_kill_9_then_rerun_gives_the_same_index(scifact_index: Path, scifact_subset: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    args = [sys.executable, "-m", "espn.cli", "index", str(scifact_subset), "--out", str(out), "--chunk-size", "32",
            "--nlist", "4", "--no-progress"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    chunks = out.with_name("resumed.partial") / "chunks"

    def two_chunks_written() -> bool:
        assert proc.poll() is None, "the build ended before it could be killed"
        return len(list(chunks.glob("*.npz"))) >= 2

    try:
        wait_until(two_chunks_written, "the build's second chunk", timeout_s=300, interval_s=0.2)
    finally:  # a timeout too leaves no build running
        proc.kill()  # SIGKILL (and nothing once the build is reaped)
        proc.wait()
    done_before = len(list(chunks.glob("*.npz")))
    assert 2 <= done_before < 5 and not out.exists(), "a killed build must leave no index at --out"

    rerun = run_espn("index", scifact_subset, "--out", out, "--chunk-size", "32", "--nlist", "4", "--no-progress")
    assert "resuming" in rerun.stderr
    IndexDirectory.open(out, verify="full")
    assert not out.with_name("resumed.partial").exists()
    for name in CONTENT_FILES:
        assert digest(out / name) == digest(scifact_index / name), name


@pytest.mark.slow
def test_two_shard_processes_then_merge(scifact_index: Path, scifact_subset: Path, tmp_path: Path) -> None:
    out = tmp_path / "sharded"
    base = [sys.executable, "-m", "espn.cli", "index", str(scifact_subset), "--out", str(out), "--chunk-size", "32",
            "--nlist", "4", "--no-progress", "--loader-workers", "0"]
    procs = [subprocess.Popen(base + ["--shard", f"{i}/2"], stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    assert not out.exists()
    run_espn("index-merge", "--out", out)
    IndexDirectory.open(out, verify="full")
    for name in CONTENT_FILES:
        assert digest(out / name) == digest(scifact_index / name), name


def test_full_disk_gives_one_line_and_no_index(tmp_path: Path) -> None:
    """A 4 MiB tmpfs fills up during the build (needs root and mount rights, as in CI's container)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN) to fill a disk")
    try:
        rows = [{"_id": f"d{i}", "title": "", "text": " ".join(["word"] * 200) + f" {i}"} for i in range(120)]
        corpus = write_jsonl(tmp_path / "corpus.jsonl", rows)
        proc = run_espn("index", corpus, "--out", mount / "index", "--bow-dim", "384", "--no-progress", check=False)
        assert proc.returncode == 1
        assert "no space left on device" in proc.stderr and "Traceback" not in proc.stderr
        assert not (mount / "index").exists()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _build_until_a_chunk(scifact_subset: Path, out: Path) -> tuple[subprocess.Popen, list]:
    import psutil

    args = [sys.executable, "-m", "espn.cli", "index", str(scifact_subset), "--out", str(out), "--chunk-size", "32",
            "--nlist", "4", "--no-progress"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    chunks = out.with_name(out.name + ".partial") / "chunks"

    def a_chunk_written() -> bool:
        assert proc.poll() is None, f"the build ended early: {proc.communicate()[1][-2000:]}"
        return len(list(chunks.glob("*.npz"))) >= 1

    try:
        wait_until(a_chunk_written, "the build's first chunk", timeout_s=300, interval_s=0.2)
    except BaseException:  # a timeout leaves no build running
        proc.kill()
        proc.wait()
        raise
    workers = psutil.Process(proc.pid).children()
    assert workers, "the build runs its tokeniser in a DataLoader worker process"
    return proc, workers


def test_kill_9_of_a_build_takes_its_worker_along(scifact_subset: Path, tmp_path: Path) -> None:
    import psutil

    proc, workers = _build_until_a_chunk(scifact_subset, tmp_path / "index")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=20)
    alive = [w for w in alive if w.status() != psutil.STATUS_ZOMBIE]
    for worker in alive:  # do not leave them behind even when the test fails
        worker.kill()
    assert not alive, "the DataLoader worker outlived the killed build (an orphan)"


def test_a_dead_worker_is_one_line_that_names_the_partial_build(scifact_subset: Path, tmp_path: Path) -> None:
    proc, workers = _build_until_a_chunk(scifact_subset, tmp_path / "index")
    for worker in workers:
        worker.kill()  # what the OOM killer does
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in stderr and "RuntimeError" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, stderr[-3000:]
    assert "tokenising worker process died" in errors[0]
    assert f"{tmp_path / 'index.partial'}" in errors[0] and "resume" in errors[0] and "delete" in errors[0]
