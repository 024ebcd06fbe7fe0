"""Snapshots and object-store records trusted for nothing (issue 44, parts 6-8), with real files,
real `espn` processes and a real S3-compatible server (moto's, started by the test):

- a damaged local snapshot restores exactly the generation it pinned or is refused in one line
  (live/CURRENT removed, a link out, a FIFO, a link to /dev/zero, a record 100,000 levels deep or
  too large, a size the record does not give), no hard link made to anything outside it, nothing
  written, no `.partial` left; `espn verify` fails on a live index whose CURRENT is missing, and
  the writer's recovery refuses it instead of removing every write;
- an oversized LATEST or generation record on the store is refused within a memory bound;
- a snapshot killed mid-copy leaves a `.partial` that the next snapshot removes; default names
  never collide; two base rewrites store the encoder once; a follower whose live/ holds symbolic
  links removes them (never follows them) and keeps fetching.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from helpers import run_espn

from espn.errors import IndexCorruptError
from espn.generation.format import MAX_RECORD_BYTES, read_current
from espn.live.checks import NewDocument
from espn.live.live_index import LiveIndex
from espn.live.snapshot import CLAIM_MARKER, default_name, restore, snapshot
from espn.generation.segments import open_view

TESTS = Path(__file__).parent


def _tree(root: Path, skip: tuple[Path, ...] = ()) -> dict[str, tuple[str, int]]:
    """Every file and link under `root` (relative path -> (sha256 or link target, link count)),
    links not followed; what a test compares before and after a refusal."""
    out: dict[str, tuple[str, int]] = {}
    for path in sorted(root.rglob("*")):
        if any(path == s or s in path.parents for s in skip) or path.suffix == ".log":
            continue
        info = os.lstat(path)
        if path.is_symlink():
            out[str(path.relative_to(root))] = ("-> " + os.readlink(path), info.st_nlink)
        elif path.is_file():
            out[str(path.relative_to(root))] = (hashlib.sha256(path.read_bytes()).hexdigest(), info.st_nlink)
    return out


@pytest.fixture(scope="module")
def written(sample_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the sample index with two writes (generation 2: a segment and a tombstone file)."""
    index = tmp_path_factory.mktemp("trust") / "index"
    shutil.copytree(sample_index, index)
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument("w1", "a write, so the snapshot has a segment"),
                       NewDocument("w2", "and a second document in it")])
        writer.delete(["s0001"])
    assert read_current(index).number == 2
    return index


@pytest.fixture(scope="module")
def pinned(written: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    snap = tmp_path_factory.mktemp("pinned") / "snap"
    assert snapshot(written, snap).generation == 2
    return snap


def _refused(source: Path, dest: Path, cli: bool) -> str:
    """The one-line refusal of a restore of `source` (by the real command line, or in process)."""
    if cli:
        started = time.monotonic()
        done = run_espn("restore", source, dest, check=False, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1, done.stderr
        assert time.monotonic() - started < 100  # refused, not hung (a FIFO) or filling a disk (/dev/zero)
        message = lines[0]
    else:
        with pytest.raises(IndexCorruptError) as refused:
            restore(source, dest)
        message = str(refused.value)
        assert "\n" not in message
    assert "internal error" not in message
    return message


def _crafted_cases(snap: Path, outside: Path) -> Iterator[tuple[str, bool, str]]:
    """(case, by the command line, what the refusal says) after crafting `snap` for it; the
    snapshot is put back between cases by the caller."""
    live, record_path = snap / "live", snap / "live" / "gen-000002.json"
    record = json.loads(record_path.read_text())

    (live / "CURRENT").unlink()
    yield "CURRENT removed (generation 2's record left)", True, "CURRENT: missing"

    (live / "CURRENT").unlink()
    first = json.loads(json.dumps(record))
    first["generation"] = 1
    record_path.unlink()
    (live / "gen-000001.json").write_text(json.dumps(first))
    yield "CURRENT removed (a first generation's record left)", False, "CURRENT: missing"

    # docs.jsonl a link to a file outside, the record's entry made to match that file.
    secret = outside / "secret.jsonl"
    crafted = json.loads(json.dumps(record))
    crafted["base"]["files"]["docs.jsonl"] = {"bytes": secret.stat().st_size,
                                              "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()}
    record_path.write_text(json.dumps(crafted))
    (snap / "docs.jsonl").unlink()
    (snap / "docs.jsonl").symlink_to(secret)
    yield "docs.jsonl a link out", True, "outside"

    (snap / "embeddings.bin").unlink()
    os.mkfifo(snap / "embeddings.bin")
    yield "embeddings.bin a FIFO", True, "FIFO"

    (snap / "ann.faiss").unlink()
    (snap / "ann.faiss").symlink_to("/dev/zero")
    yield "ann.faiss a link to /dev/zero", True, "/dev/zero"

    record_path.write_text("[" * 100_000 + "]" * 100_000)
    yield "a record nested 100,000 deep", True, "nested 100000 levels deep"

    with open(record_path, "wb") as f:  # sparse: a file of that size costs no disk
        f.truncate(MAX_RECORD_BYTES + 1)
    yield "a record over the size limit", False, f"at most {MAX_RECORD_BYTES}"

    segment = next(live.glob("seg-*"))
    with open(segment / "docs.jsonl", "ab") as f:
        f.write(b"\n")
    yield "a segment file longer than the record says", False, "the generation says"

    moved = outside / "moved-segment"
    shutil.move(str(segment), moved)
    segment.symlink_to(moved)
    yield "a segment directory linked out", False, "outside"

    (live / "CURRENT").write_text("../../../etc/passwd\n")
    yield "CURRENT naming a path", False, "not a generation record"


def test_a_damaged_snapshot_is_refused_in_one_line_and_writes_nothing(pinned: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.jsonl").write_text('{"_id": "secret", "text": "not the snapshot\'s"}\n')
    snap, dest = tmp_path / "snap", tmp_path / "restored"
    shutil.copytree(pinned, snap, symlinks=True)
    seen = []
    cases = _crafted_cases(snap, outside)
    while True:
        try:
            case, cli, says = next(cases)
        except StopIteration:
            break
        before = _tree(tmp_path, skip=(snap,))
        message = _refused(snap, dest, cli)
        assert says in message, (case, message)
        assert not dest.exists() and not dest.with_name("restored.partial").exists(), case
        assert _tree(tmp_path, skip=(snap,)) == before, case  # nothing written, no link made (link counts equal)
        assert os.stat(outside / "secret.jsonl").st_nlink == 1, case
        seen.append(case)
        # The next case starts from the untouched snapshot.
        for path in (snap, outside / "moved-segment"):
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.exists():
                shutil.rmtree(path)
        shutil.copytree(pinned, snap, symlinks=True)
    assert len(seen) == 10
    assert restore(snap, dest).generation == 2  # the untouched snapshot restores its own generation
    assert read_current(dest).number == 2


def test_verify_and_the_writer_refuse_an_index_whose_current_is_missing(written: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    shutil.copytree(written, index)
    assert run_espn("verify", index).returncode == 0
    (index / "live" / "CURRENT").unlink()
    done = run_espn("verify", index, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "CURRENT: missing" in lines[0], done.stderr
    before = _tree(index)
    with pytest.raises(IndexCorruptError, match="CURRENT: missing"):
        LiveIndex.open(index).close()  # the crash recovery would have removed every write since the build
    assert {k: v for k, v in _tree(index).items() if not k.startswith("live/LOCK")} == \
        {k: v for k, v in before.items() if not k.startswith("live/LOCK")}
    # A record newer than the one CURRENT names, with no writer at work: CURRENT was set back.
    (index / "live" / "CURRENT").write_text("gen-000001.json\n")
    shutil.copy(index / "live" / "gen-000002.json", index / "live" / "gen-000001.json")
    record = json.loads((index / "live" / "gen-000001.json").read_text())
    record["generation"] = 1
    (index / "live" / "gen-000001.json").write_text(json.dumps(record))
    done = run_espn("verify", index, check=False)
    assert done.returncode == 1 and "newer record" in done.stderr, done.stderr


def test_a_snapshot_killed_mid_copy_is_cleaned_up_by_the_next_one(written: Path, tmp_path: Path) -> None:
    snaps = tmp_path / "snaps"
    env = {**os.environ, "ESPN_TEST_CRASH_AT": "snapshot-copied:3", "TOKENIZERS_PARALLELISM": "false"}
    killed = subprocess.run([sys.executable, str(TESTS / "crash_serve.py"), "snapshot", str(written),
                             str(snaps / "killed")], env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    leftover = snaps / "killed.partial"
    assert leftover.is_dir() and (leftover / CLAIM_MARKER).exists() and any(leftover.rglob("*.faiss"))
    theirs = snaps / "theirs.partial"  # a directory of that suffix that no espn copy made: left alone
    theirs.mkdir()
    (theirs / "notes.txt").write_text("someone else's")
    name = default_name()
    result = snapshot(written, snaps / name)
    assert result.generation == 2
    assert sorted(p.name for p in snaps.iterdir()) == sorted([name, "theirs.partial"])
    assert not (snaps / name / CLAIM_MARKER).exists()
    assert run_espn("verify", snaps / name).returncode == 0


def test_default_names_never_collide_and_two_in_one_second_both_succeed(written: Path, tmp_path: Path) -> None:
    names = {default_name() for _ in range(2000)}
    assert len(names) == 2000
    snaps = tmp_path / "snaps"
    taken: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def take() -> None:
        try:
            barrier.wait()
            name = default_name()
            snapshot(written, snaps / name)
            taken.append(name)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=take) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(set(taken)) == 2, errors
    assert sorted(p.name for p in snaps.iterdir()) == sorted(taken)


def _encoder_bytes(index: Path) -> tuple[int, int, int]:
    """(bytes of encoder files as listed, bytes of their distinct inodes, bytes of every distinct inode under the index)."""
    listed, inodes, everything = 0, {}, {}
    for path in index.rglob("*"):
        if path.is_file() and not path.is_symlink():
            info = path.stat()
            everything[(info.st_dev, info.st_ino)] = info.st_size
            if "encoder" in path.relative_to(index).parts:
                listed += info.st_size
                inodes[(info.st_dev, info.st_ino)] = info.st_size
    return listed, sum(inodes.values()), sum(everything.values())


def test_two_base_rewrites_store_the_encoder_once(written: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    shutil.copytree(written, index)
    one = sum(p.stat().st_size for p in (index / "encoder").rglob("*") if p.is_file())
    before = _encoder_bytes(index)[2]
    with LiveIndex.open(index) as writer:
        writer.compact()
        writer.upsert([NewDocument("w3", "written between the two rewrites")])
        writer.compact()
    generation = read_current(index)
    assert generation.base.startswith("live/base-")
    listed, stored, total = _encoder_bytes(index)
    assert stored == one, (listed, stored, one)  # however many bases list it, its bytes are stored once
    print(f"encoder {one} bytes; index {before} bytes before, {total} after two rewrites (distinct inodes)")
    assert total < before + one // 2
    open_view(index, verify="full").close()
    snap = tmp_path / "snap"
    snapshot(index, snap)
    restored = tmp_path / "restored"
    assert restore(snap, restored).generation == generation.number
    assert run_espn("verify", restored).returncode == 0


# -- object storage ------------------------------------------------------------------------------

BUCKET = "espn-snapshot-trust"


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[Any, dict[str, str]]]:
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    from server_fixtures import s3_server

    with pytest.MonkeyPatch.context() as patch, s3_server(patch, BUCKET) as (server, env):
        yield server, env


@pytest.fixture
def client(store: tuple[Any, dict[str, str]]) -> Any:
    import boto3

    return boto3.client("s3")


# Peak resident memory as VmHWM (this process's own memory since its exec; ru_maxrss would carry
# the forking test process's peak over the exec).
_MEASURED = """
import sys
from espn.cli import main
try:
    code = main(sys.argv[2:])
finally:
    with open("/proc/self/status") as status, open(sys.argv[1], "w") as f:
        f.write(next(line.split()[1] for line in status if line.startswith("VmHWM:")))
sys.exit(code)
"""


def _restore_measured(url: str, dest: Path, tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, int]:
    """`espn restore URL DEST` in a process of its own; with its peak resident memory (KiB)."""
    rss = tmp_path / f"rss-{time.monotonic_ns()}"
    done = subprocess.run([sys.executable, "-c", _MEASURED, str(rss), "restore", url, str(dest)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env, "TOKENIZERS_PARALLELISM": "false"})
    return done, int(rss.read_text())


def test_oversized_and_deep_records_on_the_store_are_refused_within_a_memory_bound(
        tmp_path: Path, client: Any, store: tuple[Any, dict[str, str]]) -> None:
    _, env = store
    dest = tmp_path / "restored"
    # Baseline: the same command where the store holds nothing (same imports, no record read).
    absent, baseline = _restore_measured(f"s3://{BUCKET}/absent", dest, tmp_path, env)
    assert absent.returncode == 1 and "no published generation" in absent.stderr, absent.stderr
    big = 64 << 20
    client.put_object(Bucket=BUCKET, Key="huge/LATEST", Body=b"gen-000001.json" + b" " * (big - 15))
    done, peak = _restore_measured(f"s3://{BUCKET}/huge", dest, tmp_path, env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "LATEST: refused" in lines[0], done.stderr
    print(f"restore with a {big >> 20} MiB LATEST: peak RSS {peak >> 10} MiB (baseline {baseline >> 10} MiB)")
    assert peak < baseline + (16 << 10), (peak, baseline)  # KiB: not one copy of the object read
    # A generation record too large, and one nested 100,000 levels deep: one line each, nothing written.
    for prefix, body, says in (("large", b" " * (MAX_RECORD_BYTES + 1), f"at most {MAX_RECORD_BYTES}"),
                               ("deep", b"[" * 100_000 + b"]" * 100_000, "nested 100000 levels deep")):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/generations/gen-000003.json", Body=body)
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/LATEST", Body=b"gen-000003.json")
        done = run_espn("restore", f"s3://{BUCKET}/{prefix}", dest, check=False)  # AWS_* set here by the fixture
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1 and says in lines[0], done.stderr
        assert "internal error" not in lines[0]
    assert not dest.exists() and not dest.with_name("restored.partial").exists()


def test_a_follower_whose_live_holds_links_removes_them_and_keeps_fetching(
        written: Path, tmp_path: Path, client: Any, store: tuple[Any, dict[str, str]]) -> None:
    from espn.live.replication.follower import Follower
    from espn.live.replication.publisher import publish
    from espn.live.replication.restore import restore_from_store

    url = f"s3://{BUCKET}/follow"
    index = tmp_path / "index"
    shutil.copytree(written, index)
    publish(index, url)
    replica = tmp_path / "replica"
    restore_from_store(url, replica)
    outside = tmp_path / "outside"
    outside.mkdir()
    # A segment the current generation uses, swapped for a link to a copy outside; a stray
    # numbered directory that is a link (what recovery removes) too.
    segment = next((replica / "live").glob("seg-*"))
    shutil.move(str(segment), outside / "segment")
    segment.symlink_to(outside / "segment")
    (outside / "stray").mkdir()
    (outside / "stray" / "keep.txt").write_text("not the follower's")
    (replica / "live" / "seg-000099").symlink_to(outside / "stray")
    before = _tree(outside)
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument("w4", "written after the follower's links appeared")])
    publish(index, url)
    follower = Follower(url, replica, interval_s=0.1)
    assert follower.poll_once() == 3
    assert _tree(outside) == before  # nothing outside written, followed or removed
    assert not [p for p in (replica / "live").iterdir() if p.is_symlink()]
    assert run_espn("verify", replica).returncode == 0
    # And again: the next generation fetches as usual.
    with LiveIndex.open(index) as writer:
        writer.delete(["w4"])
    publish(index, url)
    assert follower.poll_once() == 4


def test_the_publishers_failed_final_upload_at_shutdown_is_logged(
        written: Path, tmp_path: Path, store: tuple[Any, dict[str, str]], caplog: pytest.LogCaptureFixture) -> None:
    from espn.live.replication.publisher import Publisher

    index = tmp_path / "index"
    shutil.copytree(written, index)
    publisher = Publisher("s3://no-such-bucket/prod", index, interval_s=0.05)  # never started: stop() makes the last try
    with caplog.at_level("WARNING", logger="espn.live.replication.publisher"):
        publisher.stop()
    lines = [r.getMessage() for r in caplog.records if "at shutdown" in r.getMessage()]
    assert len(lines) == 1 and "NoSuchBucket" in lines[0] and "generation 2" in lines[0], caplog.text
    assert "NoSuchBucket" in json.loads((index / "live" / "PUBLISHED").read_text())["error"]
