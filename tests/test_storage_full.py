"""A full disk, for real: a small tmpfs mounted by the test (root only; skipped otherwise).

Snapshots, writes and the full-text engine's commits on a filesystem with no space left:
each is a 507 (or StorageFullError) naming what was being written, nothing of it is left
behind, nothing acknowledged before is lost, and the same request succeeds once space is freed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from espn import Searcher
from espn.errors import StorageFullError
from espn.generation.segments import open_view
from espn.text.config import TextConfig
from espn.text.engine import TextDocument, TextWriter, build_text_index
from espn.live.snapshot import restore, snapshot
from server_fixtures import HTTP, running_server
from test_write_leftovers import leftovers


@contextlib.contextmanager
def small_filesystem(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes` at `path`, unmounted afterwards; skips where mounting is not allowed."""
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "espn-test", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(filesystem: Path, leave_bytes: int = 0) -> Path:
    """A ballast file taking all but `leave_bytes` of the filesystem's free space."""
    ballast = filesystem / "ballast"
    stat = os.statvfs(filesystem)
    free = stat.f_bavail * stat.f_frsize
    with open(ballast, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(1, free - leave_bytes))
    return ballast


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture
def index(sample_index: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "index"
    shutil.copytree(sample_index, copy)
    return copy


def test_a_snapshot_on_a_full_disk_is_a_507_leaving_nothing_and_succeeds_once_space_is_freed(
        index: Path, tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "disk", 2 * _tree_bytes(index) + (8 << 20)) as disk:
        snaps = disk / "snaps"
        ballast = fill(disk, leave_bytes=256 << 10)
        with running_server(index, tmp_path, "--snapshot-dir", str(snaps), "--no-warmup") as server:
            full = HTTP.post(f"{server.base_url}/v1/snapshots", json={"name": "nightly"}, timeout=120)
            assert full.status_code == 507, full.text
            assert full.json()["error"] == "insufficient_storage"
            assert "no space left on device" in full.json()["message"] and "nightly" in full.json()["message"]
            assert not (snaps / "nightly").exists() and not (snaps / "nightly.partial").exists()
            assert HTTP.get(f"{server.base_url}/v1/snapshots").json()["snapshots"] == []
            assert HTTP.post(f"{server.base_url}/v1/search", json={"query": "glaciers", "k": 3},
                              timeout=60).status_code == 200
            ballast.unlink()
            taken = HTTP.post(f"{server.base_url}/v1/snapshots", json={"name": "nightly"}, timeout=120)
            assert taken.status_code == 201, taken.text
            assert "no space left" in server.log() and "Traceback" not in server.log()
        restore(snaps / "nightly", tmp_path / "restored")
        open_view(tmp_path / "restored", verify="full").close()


def test_the_library_snapshot_on_a_full_disk_raises_storage_full_and_frees_the_name(index: Path, tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "disk", 2 * _tree_bytes(index) + (8 << 20)) as disk:
        ballast = fill(disk, leave_bytes=128 << 10)
        with pytest.raises(StorageFullError, match="no space left on device writing a snapshot"):
            snapshot(index, disk / "snap")
        assert sorted(p.name for p in disk.iterdir()) == ["ballast"]
        ballast.unlink()
        assert snapshot(index, disk / "snap").files > 0


def test_the_full_text_engine_on_a_full_disk_raises_storage_full_and_keeps_its_published_state(
        tmp_path: Path) -> None:
    """Tantivy reports ENOSPC as ValueError('An IO error occurred ...'): the engine boundary turns
    it into StorageFullError; the published directory is untouched and a new writer resumes."""
    config = TextConfig()
    with small_filesystem(tmp_path / "disk", 16 << 20) as disk:
        published = disk / "published"
        build_text_index(published, [TextDocument(i, f"title {i}", f"first text number {i}") for i in range(50)], config)
        ballast = fill(disk, leave_bytes=0)
        writer = TextWriter(disk / "work", published, config, heap_bytes=16 << 20)
        with pytest.raises(StorageFullError, match="full-text index"):
            try:  # as the writer's text side does: the engine is closed whatever happened
                writer.apply([TextDocument(100 + i, "t", f"words{i} " * 2000) for i in range(200)], [])
            finally:
                writer.close()
        ballast.unlink()
        with TextWriter(disk / "work", published, config, heap_bytes=16 << 20) as again:
            again.apply([TextDocument(1000, "after", "space came back")], [])
            files = again.publish(disk / "next")
        assert "meta.json" in files


def test_writes_on_a_full_disk_are_507_lose_nothing_acknowledged_and_resume(index: Path, tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "disk", _tree_bytes(index) + (24 << 20)) as disk:
        served = disk / "index"
        shutil.copytree(index, served)
        with running_server(served, tmp_path, "--no-warmup") as server:
            base = server.base_url
            before = HTTP.put(f"{base}/v1/documents/acked-1", json={"text": "acknowledged before the disk filled"},
                               timeout=120)
            assert before.status_code == 201, before.text
            ballast = fill(disk, leave_bytes=0)
            statuses = []
            for i in range(3):
                answer = HTTP.put(f"{base}/v1/documents/refused-{i}", json={"text": "words " * 3000}, timeout=120)
                statuses.append(answer.status_code)
                assert answer.status_code == 507, answer.text
                assert answer.json()["error"] == "insufficient_storage"
                assert "no space left on device" in answer.json()["message"]
            assert HTTP.get(f"{base}/v1/documents/acked-1").status_code == 200
            assert HTTP.get(f"{base}/v1/documents/refused-0").status_code == 404
            assert HTTP.post(f"{base}/v1/search", json={"query": "disk filled", "k": 3}, timeout=60).status_code == 200
            ballast.unlink()
            after = HTTP.put(f"{base}/v1/documents/acked-2", json={"text": "written once space came back"},
                              timeout=120)
            assert after.status_code == 201, after.text
            assert "Traceback" not in server.log()
        open_view(served, verify="full").close()
        with Searcher.open(served) as searcher:
            assert searcher.document("acked-1").text == "acknowledged before the disk filled"
            assert searcher.document("acked-2").text == "written once space came back"


def test_a_write_refused_for_a_full_disk_leaves_nothing_behind_at_once(index: Path, tmp_path: Path) -> None:
    """The 507 says nothing of the write was kept: its segment, its records past the published end and
    the full-text side's work directory (live/stage-text-*, a copy of the text index) are gone when it
    is answered, not at the next write or restart, so the space they took is free again."""
    with small_filesystem(tmp_path / "disk", _tree_bytes(index) + (24 << 20)) as disk:
        served = disk / "index"
        shutil.copytree(index, served)
        with running_server(served, tmp_path, "--no-warmup") as server:
            base = server.base_url
            assert HTTP.put(f"{base}/v1/documents/acked-1", json={"text": "kept"}, timeout=120).status_code == 201
            ballast = fill(disk, leave_bytes=64 << 10)
            refused = HTTP.put(f"{base}/v1/documents/refused", json={"text": "words " * 3000}, timeout=120)
            assert refused.status_code == 507, refused.text
            assert leftovers(served) == []
            assert not [p.name for p in (served / "live").iterdir() if p.name.startswith("stage-")]
            ballast.unlink()
            assert HTTP.put(f"{base}/v1/documents/acked-2", json={"text": "after"}, timeout=120).status_code == 201
            assert "Traceback" not in server.log()
        assert leftovers(served) == []
        assert not [p.name for p in (served / "live").iterdir() if p.name.startswith("stage-")]  # the clean stop
