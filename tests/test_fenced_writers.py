"""Fenced writers (espn.live.replication.fenced), end to end with real processes and a real
S3-compatible server (moto's, versioned, so an overwritten record shows): the sequence of
benchmarks/soak_scaleout.py (two writers started at once for one partition; the leader paused
past its lease while the standby takes over, then resumed; the new leader killed with SIGKILL
in the middle of a blob upload, then restarted), 4 clients writing throughout, 9 s of writes
instead of the soak's 60. Every acknowledged write is in a fresh restore of the published index
(read by id), no generation record has a second version, the writer that lost the partition
answers 503 `writer_superseded`, and the restarted one stands by.

In process (below them): the lease and the fence one rule at a time, against the same store.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
from helpers import wait_until

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

from benchmarks.scaleout import Cluster, Store  # noqa: E402
from benchmarks.soak_scaleout import check, failover_sequence  # noqa: E402

from espn.errors import ObjectStoreError, ReadOnlyIndexError, WriterStandbyError, WriterSupersededError  # noqa: E402
from espn.live.checks import NewDocument  # noqa: E402
from espn.live.live_index import LiveIndex  # noqa: E402
from espn.generation.format import read_current  # noqa: E402
from espn.live.replication.fence import FenceToken, advance_latest, fence_latest, publish_fenced  # noqa: E402
from espn.live.replication.fenced import LEADER, STANDBY, FencedWriter  # noqa: E402
from espn.live.replication.lease import Lease  # noqa: E402
from espn.live.replication.publisher import publish  # noqa: E402
from espn.live.replication.store import ObjectStoreUrl, make_client, read_latest  # noqa: E402

SECONDS = 9.0
LEASE_S = 4.0


@pytest.mark.slow
def test_every_acknowledged_write_is_published_through_a_pause_and_a_kill(cluster: Cluster, sample_index: Path,
                                                                           tmp_path: Path) -> None:
    check(failover_sequence(cluster, sample_index, tmp_path, SECONDS, LEASE_S))


def _copy(sample_index: Path, tmp_path: Path, name: str) -> Path:
    shutil.copytree(sample_index, tmp_path / name)
    return tmp_path / name


def test_a_lease_is_taken_once_renewed_and_taken_over_only_after_a_whole_lease_unrenewed(
        moto_store: Store) -> None:
    where = ObjectStoreUrl.parse(moto_store.url("lease-rules"))
    clock = [0.0]
    a = Lease(make_client, where, "a", "http://a", lease_s=5.0, clock=lambda: clock[0])
    b = Lease(make_client, where, "b", "http://b", lease_s=5.0, clock=lambda: clock[0])
    assert a.try_acquire() and a.epoch == 1 and a.valid()
    assert not b.try_acquire()  # first look: the ETag is noted
    clock[0] = 4.9
    assert a.renew() and not b.try_acquire()  # renewed: a new ETag, b's wait starts again
    clock[0] = 9.8
    assert not b.try_acquire()  # 4.9 s since b saw the renewal
    assert a.valid() and a.valid_until == pytest.approx(9.9)  # counted from when the renewal was sent
    clock[0] = 15.0
    assert not a.valid()  # a stops counting on it before b may take it
    assert b.try_acquire() and b.epoch == 2
    assert not a.renew() and a.held is None  # the old holder learns it lost
    b.release()
    again = Lease(make_client, where, "a", lease_s=5.0, clock=lambda: clock[0])
    assert again.try_acquire() and again.epoch == 3  # released: taken at once


def test_a_restarted_writer_takes_its_own_lease_back_at_once_and_only_at_its_first_look(
        moto_store: Store) -> None:
    where = ObjectStoreUrl.parse(moto_store.url("lease-restart"))
    first = Lease(make_client, where, "pod-0", lease_s=30.0)
    assert first.try_acquire()
    restarted = Lease(make_client, where, "pod-0", lease_s=30.0)  # the same name, a new process
    assert restarted.try_acquire() and restarted.epoch == 2
    other = Lease(make_client, where, "pod-1", lease_s=30.0)
    assert not other.try_acquire() and not other.try_acquire()


def test_after_a_fence_no_older_epoch_moves_latest_and_the_unleased_publish_is_refused(
        moto_store: Store, sample_index: Path, tmp_path: Path) -> None:
    url = moto_store.url("fence-rules")
    where, client = ObjectStoreUrl.parse(url), make_client()
    publish(sample_index, url)  # generation 0, epoch 0 (no lease)
    old, new = FenceToken(1, "a/000000000001"), FenceToken(2, "b/000000000002")
    seen = fence_latest(client, where, old)
    assert seen is not None and seen.epoch == 1
    assert fence_latest(client, where, new).epoch == 2
    with pytest.raises(WriterSupersededError, match="epoch 2"):
        advance_latest(client, where, "gen-000001.json", old, seen)  # what it last read is stale: refused
    latest = read_latest(client, where)
    assert latest is not None and (latest.name, latest.epoch) == ("gen-000000.json", 2)
    with pytest.raises(ObjectStoreError, match="leased writer"):
        publish(sample_index, url)  # `espn publish` on a prefix a leased writer owns


def test_a_superseded_writers_orphan_record_is_skipped_not_overwritten(moto_store: Store, sample_index: Path,
                                                                       tmp_path: Path) -> None:
    """Writer A (epoch 1) wrote record 1 and was fenced before its LATEST write: B (epoch 2)
    publishes its own generation 1 as generation 2, and record 1 keeps its one version."""
    url = moto_store.url("orphan")
    where, client = ObjectStoreUrl.parse(url), make_client()
    index = _copy(sample_index, tmp_path, "b")
    old, new = FenceToken(1, "a/00000000000a"), FenceToken(2, "b/00000000000b")
    first = publish_fenced(client, where, index, read_current(index), old, set(), None)
    assert first.latest.epoch == 1
    orphan = {"generation": dict(read_current(index).to_json(), generation=1), "pieces": [], "epoch": 1}
    client.put_object(Bucket=moto_store.bucket, Key="orphan/generations/gen-000001.json", Body=json.dumps(orphan).encode())
    fence_latest(client, where, new)
    with LiveIndex(index) as writer:  # B's next generation, staged here: number 1, taken on the store
        staged = writer.upsert([NewDocument("b1", "written by the new writer")]).generation
    assert staged == 1
    published = publish_fenced(client, where, index, read_current(index), new, set(), None)
    assert published.generation.number == 2 and published.latest.name == "gen-000002.json"
    assert moto_store.versions("orphan/generations/") == {"orphan/generations/gen-000000.json": 1,
                                                     "orphan/generations/gen-000001.json": 1,
                                                     "orphan/generations/gen-000002.json": 1}
    with pytest.raises(WriterSupersededError):  # and A, resumed, publishes nothing more
        advance_latest(client, where, "gen-000003.json", old, first.latest)


def test_a_standby_refuses_writes_and_an_unfenced_writer_refuses_a_fenced_index(
        moto_store: Store, sample_index: Path, tmp_path: Path) -> None:
    url = moto_store.url("standby-rules")
    a_dir, b_dir = _copy(sample_index, tmp_path, "a"), _copy(sample_index, tmp_path, "b")
    a = FencedWriter(url, a_dir, 0.1, name="wa", lease_s=6.0)
    b = FencedWriter(url, b_dir, 0.1, name="wb", lease_s=6.0)
    try:
        a.start()
        # Leading, and done with its first publish (the whole index, under the writer lock: a write
        # meanwhile would find the lock taken).
        _until(lambda: a.role == LEADER and a.status()["published_generation"] == 0)
        b.start()
        with LiveIndex(a_dir, fence=a) as writer:
            assert writer.upsert([NewDocument("f1", "a fenced write")]).generation == 1
        with LiveIndex(b_dir, fence=b) as writer, pytest.raises(WriterStandbyError, match="the writer is wa"):
            writer.upsert([NewDocument("f2", "to the standby")])
        with LiveIndex(a_dir) as unfenced, pytest.raises(ReadOnlyIndexError, match="fenced writer"):
            unfenced.upsert([NewDocument("f3", "around the fence")])
        _until(lambda: b.status()["generation"] == 1)  # the standby follows what the leader published
        a.stop()  # releases the lease: the standby takes over at its next look
        # Leading, and done with its first look at what the store holds (a publish under the writer
        # lock when it finds its generation not recorded as its own publish).
        _until(lambda: b.role == LEADER and b.status()["published_generation"] == 1)
        assert a.role == STANDBY
        with LiveIndex(b_dir, fence=b) as writer:
            assert writer.upsert([NewDocument("f4", "after the takeover")]).generation == 2
    finally:
        a.stop()
        b.stop()


def _until(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    wait_until(check, "the writers", timeout_s=timeout_s, interval_s=0.1)
