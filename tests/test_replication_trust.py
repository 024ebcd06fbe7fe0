"""Replication that can be trusted (issue 31), against a real S3-compatible server (moto's,
started by the test) and real processes (`espn serve`, `espn restore`):

- a crafted generation record (`..`, absolute and nested paths, a piece naming a file outside the
  index, a base outside it) is refused in one line naming the piece, by `espn restore s3://...`, a
  follower and `espn restore` from a local snapshot, and nothing is written outside the target;
- a corrupted blob is refused and nothing is renamed into place;
- a store emptied under a running writer (`espn serve --publish`) is noticed: /readyz says stale
  until the store holds the whole generation again, which the writer re-uploads by itself;
- the publisher outlives repeated store outages and the writer's crash recovery running beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from helpers import run_espn, wait_until
from server_fixtures import HTTP, running_server, s3_server

from espn import Searcher
from espn.errors import IndexCorruptError
from espn.generation.format import read_current
from espn.live.checks import NewDocument
from espn.live.live_index import LiveIndex
from espn.live.replication.follower import Follower
from espn.live.replication.publisher import Publisher, publish
from espn.live.replication.restore import restore_from_store
from espn.live.snapshot import restore, snapshot

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

BUCKET = "espn-trust"


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[Any, dict[str, str]]]:
    """One moto server for the module (tests use their own prefixes); AWS_* set for this process."""
    with pytest.MonkeyPatch.context() as patch, s3_server(patch, BUCKET) as (server, env):
        yield server, env


@pytest.fixture
def client(store: tuple[Any, dict[str, str]]) -> Any:
    import boto3

    return boto3.client("s3")


def _tree(root: Path) -> dict[str, str]:
    """Every file under `root` but servers' logs (relative path -> sha256 of its bytes): what a test
    compares before and after."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink() and path.suffix != ".log":
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _written(tmp_path: Path, sample_index: Path, prefix: str) -> Path:
    """A copy of the sample index with one write (generation 1: a segment, embeddings.bin ranges), published."""
    index = tmp_path / "index"
    shutil.copytree(sample_index, index)
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument("w1", "a document written before the first publish")])
    publish(index, f"s3://{BUCKET}/{prefix}")
    return index


def _put_record(client: Any, prefix: str, record: dict[str, Any], number: int) -> None:
    name = f"gen-{number:06d}.json"
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/generations/{name}", Body=json.dumps(record).encode())
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/LATEST", Body=name.encode())


def _crafted(record: dict[str, Any], path: str) -> dict[str, Any]:
    """The record with generation 99 and one more piece, named `path` (bytes of a blob that is stored)."""
    crafted = json.loads(json.dumps(record))
    crafted["generation"]["generation"] = 99
    stored = next(p for p in crafted["pieces"] if p["path"].endswith("docs.jsonl"))
    crafted["pieces"].append({**stored, "path": path})
    return crafted


def test_crafted_records_are_refused_before_anything_is_written(sample_index: Path, tmp_path: Path, client: Any,
                                                                store: tuple[Any, dict[str, str]]) -> None:
    prefix = "crafted"
    url = f"s3://{BUCKET}/{prefix}"
    index = _written(tmp_path, sample_index, prefix)
    good = json.loads(client.get_object(Bucket=BUCKET, Key=f"{prefix}/generations/gen-000001.json")["Body"].read())
    # A file of the same kind outside every index: a piece naming it must not touch it.
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "embeddings.bin").write_bytes(b"precious bytes")
    replica = tmp_path / "replica"
    restore_from_store(url, replica)

    outside = tmp_path / "x" / "evil.txt"
    base_outside = json.loads(json.dumps(good))
    base_outside["generation"]["generation"] = 99
    base_outside["generation"]["base"]["path"] = "../x"  # the generation itself, not only a piece, leads out
    cases = {
        "../x/evil.txt": _crafted(good, "../x/evil.txt"),
        str(outside): _crafted(good, str(outside)),
        "live/../../x/evil.txt": _crafted(good, "live/../../x/evil.txt"),
        "../victim/embeddings.bin": _crafted(good, "../victim/embeddings.bin"),
        "live/CURRENT": _crafted(good, "live/CURRENT"),
        "ann.faiss.extra": _crafted(good, "ann.faiss.extra"),  # a safe name, but no file the generation needs
        "../x/manifest.json": base_outside,
    }
    with running_server(replica, tmp_path, "--follow", url, "--follow-interval-s", "0.2", env=store[1],
                        name="follower") as follower:
        before = _tree(tmp_path)
        for number, (piece, record) in enumerate(cases.items()):
            _put_record(client, prefix, record, 99)
            if number == 0:  # the real command line (a process: once is enough to show the line)
                restored = run_espn("restore", url, tmp_path / "restored", check=False)
                lines = restored.stderr.strip().splitlines()
                assert restored.returncode == 1 and len(lines) == 1, restored.stderr
                message = lines[0]
            else:
                with pytest.raises(IndexCorruptError) as refused:
                    restore_from_store(url, tmp_path / "restored")
                message = str(refused.value)
            assert repr(piece) in message and "gen-000099.json" in message and "internal error" not in message
            # The follower refuses the same record, keeps serving generation 1 and says why in a sentence.
            wait_until(lambda: repr(piece) in str(_replication(follower).get("last_error")), f"the follower refusing {piece}")
            status = _replication(follower)
            assert status["stale"] and status["generation"] == 1 and status["source_generation"] == 99
            assert _tree(tmp_path) == before  # nothing written anywhere, the replica included
        # Each refusal was logged once, not at every poll (5 polls a second).
        log = follower.log()
        assert log.count("'../x/evil.txt'") == 1, log[-3000:]
        # A good record again: the follower catches up, and nothing of the refused ones is left anywhere.
        _put_record(client, prefix, good, 1)
        with LiveIndex.open(index) as writer:
            writer.upsert([NewDocument("w2", "the write after the attacks")])
        publish(index, url)
        wait_until(lambda: HTTP.get(f"{follower.base_url}/v1/documents/w2").status_code == 200,
               "the follower to serve generation 2")
        assert not _replication(follower)["stale"]
    assert not outside.exists() and not (tmp_path / "restored").exists() and not (tmp_path / "restored.partial").exists()
    assert (victim / "embeddings.bin").read_bytes() == b"precious bytes"
    assert not list(tmp_path.rglob("*.fetch.tmp")) and not list(tmp_path.rglob("evil*"))


def _replication(server: Any) -> dict[str, Any]:
    return HTTP.get(f"{server.base_url}/readyz").json().get("replication") or {}


def test_a_corrupted_blob_is_refused_and_nothing_is_renamed_into_place(sample_index: Path, tmp_path: Path,
                                                                      client: Any) -> None:
    prefix = "corrupted"
    url = f"s3://{BUCKET}/{prefix}"
    index = _written(tmp_path, sample_index, prefix)
    replica = tmp_path / "replica"
    restore_from_store(url, replica)
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument("w2", "a second write, fetched by the follower")])
    publish(index, url)
    generation = read_current(index)
    segment = generation.segments[-1]
    ann = f"live/{segment.name}/ann.faiss"
    ranges = [r for r in segment.records]
    embeddings_before = (replica / "embeddings.bin").stat().st_size
    for sha in (segment.files["ann.faiss"]["sha256"], ranges[0].sha256):  # a whole file, then an appended range
        key = f"{prefix}/blobs/{sha}"
        good = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0xFF  # same size, wrong sha256
        client.put_object(Bucket=BUCKET, Key=key, Body=bytes(bad))
        follower = Follower(url, replica)
        with pytest.raises(IndexCorruptError, match="does not match its sha256") as refused:
            follower.poll_once()
        assert "gen-000002.json" in str(refused.value) and key in str(refused.value)
        assert read_current(replica).number == 1 and not list(replica.rglob("*.fetch.tmp"))
        if sha == ranges[0].sha256:  # nothing appended to the served file
            assert (replica / "embeddings.bin").stat().st_size == embeddings_before
        else:  # nothing renamed into place
            assert not (replica / ann).exists()
        with pytest.raises(IndexCorruptError, match="corrupted in the store"):
            restore_from_store(url, tmp_path / "restored")
        assert not (tmp_path / "restored").exists() and not (tmp_path / "restored.partial").exists()
        client.put_object(Bucket=BUCKET, Key=key, Body=good)
    # A missing blob is named as missing, not as an internal error.
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/blobs/{segment.files['ann.faiss']['sha256']}")
    restored = run_espn("restore", url, tmp_path / "restored", check=False)
    assert restored.returncode == 1 and "NoSuchKey" in restored.stderr and repr(ann) in restored.stderr
    assert "internal error" not in restored.stderr and len(restored.stderr.strip().splitlines()) == 1
    publish(index, url)  # the publisher finds it missing (HEAD) and uploads it again
    assert Follower(url, replica).poll_once() == 2
    assert restore_from_store(url, tmp_path / "restored") == 2


def test_a_crafted_local_snapshot_is_refused(sample_index: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    shutil.copytree(sample_index, index)
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument("w1", "a write, so the snapshot has a generation record")])
        writer.delete(["s0001"])
    snap = tmp_path / "snap"
    snapshot(index, snap)
    record_path = snap / "live" / "gen-000002.json"
    record = json.loads(record_path.read_text())
    before = _tree(tmp_path)
    for field, value, named in (("tombstones", "../../../evil.npy", "live/../../../evil.npy"),
                                ("segments", "../../evil", "live/../../evil/ann.faiss")):
        crafted = json.loads(json.dumps(record))
        crafted[field][0]["file" if field == "tombstones" else "name"] = value
        record_path.write_text(json.dumps(crafted))
        if field == "tombstones":  # the real command line once: one line, exit 1
            restored = run_espn("restore", snap, tmp_path / "restored", check=False)
            lines = restored.stderr.strip().splitlines()
            assert restored.returncode == 1 and len(lines) == 1 and repr(named) in lines[0], restored.stderr
        else:
            with pytest.raises(IndexCorruptError, match=re.escape(repr(named))):
                restore(snap, tmp_path / "restored")
        assert _tree(tmp_path) == {**before, "snap/live/gen-000002.json": _tree(snap)["live/gen-000002.json"]}
    record_path.write_text(json.dumps(record))
    restore(snap, tmp_path / "restored")  # the untouched snapshot restores
    assert not list(tmp_path.rglob("evil*"))


def test_the_publisher_outlives_store_outages_and_the_writers_recovery(sample_index: Path, tmp_path: Path,
                                                                      store: tuple[Any, dict[str, str]]) -> None:
    """In process (the thread is observable): the store stops and starts three times while writes go
    on and another writer's recovery (which removes live/*.tmp) runs beside the publisher."""
    server, _ = store
    url = f"s3://{BUCKET}/outages"
    index = tmp_path / "index"
    shutil.copytree(sample_index, index)
    publisher = Publisher(url, index, interval_s=0.05).start()
    stop = threading.Event()

    def recover_all_the_time() -> None:
        while not stop.is_set():
            with LiveIndex.open(index, wait_s=30):  # takes the writer lock and runs crash recovery
                pass

    recovery = threading.Thread(target=recover_all_the_time)
    recovery.start()
    try:
        for outage in range(3):
            wait_until(lambda: publisher.status()["lag_generations"] == 0 and not publisher.status()["stale"],
                   f"publishing before outage {outage}")
            server.stop()
            with LiveIndex.open(index, wait_s=30) as writer:
                writer.upsert([NewDocument(f"o{outage}", f"written during outage {outage}")])
            wait_until(lambda: publisher.status()["stale"], f"stale during outage {outage}")
            assert publisher.alive and publisher.status()["lag_generations"] == 1
            server.start()
        wait_until(lambda: publisher.status()["lag_generations"] == 0 and not publisher.status()["stale"],
               "publishing after the last outage")
        assert publisher.alive
    finally:
        stop.set()
        recovery.join()
        publisher.stop()
    restored = tmp_path / "restored"
    assert restore_from_store(url, restored) == read_current(index).number == 3
    with Searcher.open(restored) as searcher:  # every write acknowledged during an outage is on the store
        assert [searcher.document(f"o{i}").text for i in range(3)] == [f"written during outage {i}" for i in range(3)]


def test_a_lost_generation_is_unpublished_in_the_status_before_the_warning_names_it(
        sample_index: Path, tmp_path: Path, client: Any, store: tuple[Any, dict[str, str]]) -> None:
    """Whoever acts on the warning (an operator, a script, the test below) must not read "published"
    from /readyz while the re-upload runs: CI once restored in that gap and met a missing blob."""
    prefix = "lost-order"
    url = f"s3://{BUCKET}/{prefix}"
    index = _written(tmp_path, sample_index, prefix)
    publisher = Publisher(url, index, interval_s=60, verify_every_s=0)  # not started: driven here, checking each time
    assert publisher.publish_once() == 1 and publisher.status()["published_generation"] == 1
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/"):
        for item in page.get("Contents", []):  # the store loses every object of the prefix
            client.delete_object(Bucket=BUCKET, Key=item["Key"])
    seen: list[dict[str, Any]] = []

    class StatusWhenWarned(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "the store lost generation 1" in record.getMessage():
                seen.append(publisher.status())

    handler, logger = StatusWhenWarned(), logging.getLogger("espn.live.replication.publisher")
    logger.addHandler(handler)
    try:
        assert publisher.publish_once() == 1  # noticed, then published again
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 1 and seen[0]["published_generation"] is None and seen[0]["stale"], seen
    assert publisher.status()["published_generation"] == 1 and not publisher.status()["stale"]
    assert restore_from_store(url, tmp_path / "restored") == 1


@pytest.mark.slow
def test_a_store_emptied_under_a_running_writer_is_noticed_and_refilled(sample_index: Path, tmp_path: Path,
                                                                       client: Any,
                                                                       store: tuple[Any, dict[str, str]]) -> None:
    """A fenced writer acknowledges only what the store holds: while the store is gone a write is
    refused (503, nothing acknowledged); once it is back the writer takes its lease again and
    uploads its whole generation, with or without a write to make it look."""
    env = store[1]
    url = f"s3://{BUCKET}/emptied"
    index = tmp_path / "index"
    shutil.copytree(sample_index, index)

    def reset_store() -> None:  # the S3 server restarted empty: every bucket and object gone
        HTTP.post(f"{env['AWS_ENDPOINT_URL']}/moto-api/reset").raise_for_status()

    with running_server(index, tmp_path, "--publish", url, "--publish-interval-s", "0.1", "--writer-lease-s", "3",
                        env=env, name="writer") as writer:
        def write(doc_id: str) -> Any:
            return HTTP.put(f"{writer.base_url}/v1/documents/{doc_id}", json={"text": f"document {doc_id}"})

        def restored(into: str) -> list[str]:
            run_espn("restore", url, tmp_path / into)
            with Searcher.open(tmp_path / into) as searcher:
                return [searcher.document(doc_id).text for doc_id in ("a1", "a2")]

        assert write("a1").status_code == 201
        # 1. The store restarts empty and stays without its bucket: a write is refused, naming
        # the cause, and nothing of it is acknowledged; /readyz says stale.
        reset_store()
        refused = write("a2")
        assert refused.status_code == 503 and refused.json()["error"] in ("write_failed", "writer_standby",
                                                                          "writer_superseded"), refused.text
        wait_until(lambda: _replication(writer)["stale"], "stale after the store emptied")
        failed = run_espn("restore", url, tmp_path / "r0", check=False)
        assert failed.returncode == 1 and "NoSuchBucket" in failed.stderr and "internal error" not in failed.stderr
        # 2. The bucket is back: the writer takes its lease again and publishes its whole
        # generation; the write goes through when retried.
        client.create_bucket(Bucket=BUCKET)
        wait_until(lambda: write("a2").status_code == 201, "a write to go through again", timeout_s=60)
        assert restored("r1") == ["document a1", "document a2"]
        # 3. Emptied and the bucket recreated between two looks, with no write: the writer finds
        # its lease gone at its next renewal, takes it again and uploads everything.
        reset_store()
        client.create_bucket(Bucket=BUCKET)
        wait_until(lambda: _replication(writer).get("role") == "leader" and
                   _replication(writer)["published_generation"] == read_current(index).number and
                   client.list_objects_v2(Bucket=BUCKET, Prefix="emptied/LATEST").get("KeyCount", 0) == 1,
                   "the writer to publish its generation again", timeout_s=60)
        assert restored("r2") == ["document a1", "document a2"]
        log = writer.log()
        assert "Exception in thread" not in log and "Traceback" not in log, log[-3000:]
