"""Generations published to object storage and restored from it, against a real S3-compatible
server (moto's, started on a free port by the test; boto3 talks to it over HTTP)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Iterator

import pytest

from espn import Searcher
from espn.cli import main as cli_main
from espn.errors import DocumentNotFoundError, IndexCorruptError, InvalidParameterError
from espn.generation.format import read_current
from espn.live.checks import NewDocument
from espn.live.live_index import LiveIndex
from espn.live.replication.publisher import publish
from espn.live.replication.restore import restore_from_store
from helpers import wait_until

pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

BUCKET = "espn-backups"
URL = f"s3://{BUCKET}/indexes/sample"


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def store(s3: str, monkeypatch: pytest.MonkeyPatch) -> object:
    import boto3

    for name, value in {"AWS_ENDPOINT_URL": s3, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3")
    if BUCKET in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    else:
        client.create_bucket(Bucket=BUCKET)
    return client


def test_publish_then_restore_each_generation(sample_index: Path, tmp_path: Path, store) -> None:
    index = tmp_path / "index"
    shutil.copytree(sample_index, index)
    first = publish(index, URL)
    assert first.generation == 0 and first.uploaded > 10 and first.already_there == 0
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument("stored", "a document about zyxolith written after the first publish")])
        writer.delete(["s0003"])
    second = publish(index, URL)
    # Only what the writes made is uploaded again: the base's files are stored by content already.
    assert second.generation == 2 and second.already_there >= first.uploaded - 2 and second.uploaded < 30
    assert publish(index, URL).uploaded == 0  # idempotent: a retry uploads nothing
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument("unpublished", "written but never published")])

    latest = tmp_path / "latest"
    assert cli_main(["restore", URL, str(latest)]) == 0
    assert read_current(latest).number == 2
    with Searcher.open(latest) as searcher:
        assert searcher.search(["zyxolith"], k=1, mode="lexical")[0].hits[0].doc_id == "stored"
        for missing in ("s0003", "unpublished"):
            with pytest.raises(DocumentNotFoundError):
                searcher.document(missing)
    old = tmp_path / "generation-0"
    assert restore_from_store(URL, old, generation=0) == 0
    with Searcher.open(old) as searcher:
        assert searcher.document("s0003").doc_id == "s0003"
    # A restored index is an index like any other: it takes writes.
    with LiveIndex.open(latest) as writer:
        writer.upsert([NewDocument("after-restore", "written to the restored copy")])


def test_a_corrupted_blob_or_a_missing_generation_restores_nothing(sample_index: Path, tmp_path: Path, store) -> None:
    index = tmp_path / "index"
    shutil.copytree(sample_index, index)
    publish(index, URL)
    with pytest.raises(InvalidParameterError, match="no published generation"):
        restore_from_store(URL, tmp_path / "none", generation=7)
    blobs = [o for o in store.list_objects_v2(Bucket=BUCKET, Prefix="indexes/sample/blobs/")["Contents"]]
    victim = max(blobs, key=lambda o: o["Size"])  # a large one: embeddings.bin or the model
    body = bytearray(store.get_object(Bucket=BUCKET, Key=victim["Key"])["Body"].read())
    body[len(body) // 2] ^= 0xFF
    store.put_object(Bucket=BUCKET, Key=victim["Key"], Body=bytes(body))
    with pytest.raises(IndexCorruptError, match="corrupted in the store"):
        restore_from_store(URL, tmp_path / "restored")
    assert not (tmp_path / "restored").exists() and not (tmp_path / "restored.partial").exists()
    # A local file that no longer matches its generation is never published.
    with open(index / "ids.npy", "r+b") as f:
        f.seek(200)
        f.write(b"\xff")
    store.delete_object(Bucket=BUCKET, Key=f"indexes/sample/blobs/{read_current(index).base_files['ids.npy']['sha256']}")
    with pytest.raises(IndexCorruptError, match="ids.npy"):
        publish(index, URL)


def test_retention_keeps_the_newest_generations_and_what_they_need(sample_index: Path, tmp_path: Path, store) -> None:
    index = tmp_path / "index"
    shutil.copytree(sample_index, index)
    for i in range(3):
        with LiveIndex.open(index) as writer:
            writer.upsert([NewDocument(f"g-{i}", f"generation {i} of the retention test")])
        publish(index, URL)
    # Young blobs are never deleted (a publish in progress uploads them before its record).
    young = cli_main(["publish", str(index), URL, "--keep", "1"])
    assert young == 0 and len(store.list_objects_v2(Bucket=BUCKET, Prefix="indexes/sample/generations/")["Contents"]) == 1
    blobs_before = store.list_objects_v2(Bucket=BUCKET, Prefix="indexes/sample/blobs/")["KeyCount"]
    from espn.live.replication.retention import apply_retention

    dropped = apply_retention(URL, keep=1, min_age_s=0)
    assert dropped.records_deleted == 0 and dropped.blobs_deleted >= 2  # older generations' text-index meta.json
    assert store.list_objects_v2(Bucket=BUCKET, Prefix="indexes/sample/blobs/")["KeyCount"] == \
        blobs_before - dropped.blobs_deleted
    restored = tmp_path / "restored"
    assert restore_from_store(URL, restored) == read_current(index).number
    with Searcher.open(restored) as searcher:
        assert [searcher.document(f"g-{i}").doc_id for i in range(3)] == ["g-0", "g-1", "g-2"]
    with pytest.raises(InvalidParameterError, match="no published generation"):
        restore_from_store(URL, tmp_path / "old", generation=1)
    with pytest.raises(InvalidParameterError, match="at least 1"):
        apply_retention(URL, keep=0)


def test_the_writers_publisher_uploads_each_generation_once_and_keeps_writing_while_the_store_is_away(
        sample_index: Path, tmp_path: Path, store, monkeypatch: pytest.MonkeyPatch) -> None:
    from espn.live.replication.publisher import Publisher

    index = tmp_path / "index"
    shutil.copytree(sample_index, index)
    publisher = Publisher(URL, index, interval_s=0.1)
    second = Publisher(URL, index, interval_s=0.1)  # another worker of the same server
    assert publisher._owns_lock() and not second._owns_lock()  # one process per index publishes
    assert publisher.publish_once() == 0 and publisher.publish_once() is None  # nothing new: nothing sent
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument("p1", "first write after the base")])
        writer.upsert([NewDocument("p2", "second write")])
    status = second.status()  # any worker reports the same, from live/PUBLISHED
    assert status["lag_generations"] == 2 and status["published_generation"] == 0 and not status["stale"]
    assert publisher.publish_once() == 2
    assert second.status()["lag_generations"] == 0

    # The store is away (an endpoint nothing listens on): writes go on, the writer reports stale.
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    publisher._client = None
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument("p3", "written while the store was away")])
    publisher.start()
    try:
        wait_until(lambda: second.status()["stale"], "the writer to report the store stale", timeout_s=30)
        status = second.status()
        assert status["stale"] and status["lag_generations"] == 1 and status["last_error"]
        monkeypatch.undo()  # the store is back
        store_env = {"AWS_ENDPOINT_URL": store.meta.endpoint_url, "AWS_ACCESS_KEY_ID": "test",
                     "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        for name, value in store_env.items():
            monkeypatch.setenv(name, value)
    finally:
        publisher.stop()  # the lock holder publishes what is committed one last time
    assert not second.status()["stale"] and second.status()["published_generation"] == 3
    restored = tmp_path / "restored"
    assert restore_from_store(URL, restored) == 3
    with Searcher.open(restored) as searcher:
        assert searcher.document("p3").text == "written while the store was away"

    # LATEST never moves back: publishing an older copy of the index after a newer one.
    older = tmp_path / "older"
    shutil.copytree(sample_index, older)
    publish(older, URL)
    assert store.get_object(Bucket=BUCKET, Key="indexes/sample/LATEST")["Body"].read() == b"gen-000003.json"
