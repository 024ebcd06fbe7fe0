"""The shard map (espn.shard_map) and what reads it: the router over replicas and a reshard.

End to end with real processes and a real S3-compatible server (moto's), the scenarios of
benchmarks/soak_partitions.py run short: 2 partitions x 2 replicas behind `espn route
--shard-map`, one replica killed with SIGKILL during 300 searches (0 failed, the same rankings
as the healthy run); and 4 clients writing through the router while `espn reshard` splits 2
partitions into 3 and merges them back (every acknowledged document found once by id and by
search, held by one partition, nothing encoded to move it).

In process: the map's rules (a build's placement is the map's, crafted maps refused, plans
that move the fewest slots) and its conditional writes.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

from benchmarks.scaleout import Cluster, Store  # noqa: E402
from benchmarks.soak_partitions import check, replica_kill, split_and_merge  # noqa: E402

from espn.engine import ShardMapView  # noqa: E402
from espn.errors import IndexCorruptError, InvalidParameterError  # noqa: E402
from espn.live.replication.cluster import (MAP_NAME, Registration, init_map, map_url, partition_url,  # noqa: E402
                                           read_map, read_map_if_changed, write_map)
from espn.live.replication.reshard import Resharder  # noqa: E402
from espn.live.replication.store import ObjectStoreUrl, make_client  # noqa: E402
from espn.partitioning import SLOT_COUNT, owners  # noqa: E402
from espn.shard_map import MAX_MAP_BYTES, ShardMap, plan_moves  # noqa: E402
from espn_server.router.routing import MapRouting  # noqa: E402


@pytest.mark.slow
def test_a_replica_killed_during_searches_fails_none_and_changes_no_ranking(cluster: Cluster, sample_partitions: Path,
                                                                             tmp_path: Path) -> None:
    check(replica_kill(cluster, sample_partitions, tmp_path, searches=300))


@pytest.mark.slow
def test_a_split_and_a_merge_under_writes_keep_every_document_once(cluster: Cluster, sample_partitions: Path,
                                                                   tmp_path: Path) -> None:
    result = split_and_merge(cluster, sample_partitions, tmp_path, seconds=6.0)
    check(result)
    # Each finished move's report line (its progress lines, copying, freezing and switched, say the
    # same move-id): 0->2 and 1->2, then 2->0 and 2->1.
    reports = [line for line in result["split"] + result["merge"] if line.startswith("move-") and " documents (" in line]
    pairs = sorted(tuple(map(int, re.search(r"from partition (\d+) to (\d+):", line).groups())) for line in reports)
    assert pairs == [(0, 2), (1, 2), (2, 0), (2, 1)], result["split"] + result["merge"]


def test_a_build_of_a_power_of_two_partitions_is_placed_as_its_initial_map_says() -> None:
    ids = np.array([f"doc-{i}".encode() for i in range(5000)], dtype=bytes)
    for count in (1, 2, 4, 8):
        assert np.array_equal(ShardMap.initial(count).owners_of(ids), owners(ids, count))
    with pytest.raises(InvalidParameterError, match="divide"):
        ShardMap.initial(3)


def test_plans_move_the_fewest_slots_and_balance_the_partitions() -> None:
    shard_map = ShardMap.initial(2)
    moves = plan_moves(shard_map, 3)
    assert [(len(slots), source, target) for slots, source, target in moves] == [(170, 0, 2), (171, 1, 2)]
    grown, _ = shard_map.with_partition("part-2")
    for slots, source, target in moves:
        grown, move = grown.with_move(slots, source, target)
        assert grown.owner_array[slots].tolist() == [source] * len(slots)  # copying: still the source's
        grown = grown.with_state(move.id, "freezing").with_state(move.id, "switched").without_move(move.id)
    assert sorted(np.bincount(grown.owner_array).tolist()) == [341, 341, 342]
    back = plan_moves(grown, 2)
    assert [(source, target) for _, source, target in back] == [(2, 0), (2, 1)]
    assert sum(len(slots) for slots, _, _ in back) == 341
    with pytest.raises(InvalidParameterError, match="already moving"):
        grown.with_move(back[0][0], 2, 0)[0].with_move(back[0][0][:1], 2, 1)


@pytest.mark.parametrize("edit, rule", [
    (lambda m: m.update(owners=m["owners"][:-1]), "owners"),
    (lambda m: m.update(owners=[7] * SLOT_COUNT), "owners"),
    (lambda m: m["partitions"][1].update(store="../elsewhere"), "relative prefixes"),
    (lambda m: m["partitions"][1].update(store="part-0"), "distinct"),
    (lambda m: m.update(slots=512), "slots"),
    (lambda m: m.update(moves=[{"id": "move-000001", "slots": [1], "source": 0, "target": 1,
                                "state": "copying"}]), "not owned by partition 0"),
    (lambda m: m.update(moves=[{"id": "move-000001", "slots": [0], "source": 0, "target": 0,
                                "state": "copying"}]), "free slots"),
    (lambda m: m.update(version="7"), "integer"),
])
def test_a_crafted_map_is_refused_naming_the_rule(edit, rule: str) -> None:  # noqa: ANN001
    stored = json.loads(ShardMap.initial(2).to_bytes())
    edit(stored)
    with pytest.raises(IndexCorruptError, match=rule):
        ShardMap.parse(json.dumps(stored).encode(), "s3://b/shard-map.json")


def test_the_map_moves_only_by_a_conditional_write_on_what_was_read(moto_store: Store) -> None:
    where, client = map_url(moto_store.url("conditional-map")), make_client()
    first = ShardMap.initial(2)
    etag = write_map(client, where, first, None)
    assert etag and write_map(client, where, first, None) is None  # one map per prefix
    found = read_map(client, where)
    assert found is not None and found[0] == first
    assert read_map_if_changed(client, where, found[1]) is None  # unchanged: a 304, no body
    grown = first.with_partition("part-2")[0]
    assert write_map(client, where, grown, found[1]) is not None
    assert write_map(client, where, grown.with_partition("part-3")[0], found[1]) is None  # read before the change
    changed = read_map_if_changed(client, where, found[1])
    assert changed is not None and changed[0].version == grown.version


def test_the_router_reads_a_map_its_replicas_and_writers_through_the_engines_view(moto_store: Store) -> None:
    """espn.engine.ShardMapView, what `espn route --shard-map` routes by: the map's partitions and
    owners, each partition's registered replicas, no writer while no lease is held, and the next
    view re-reading the members (the map itself only when its ETag moved)."""
    url = moto_store.url("view")
    shard_map = init_map(url, 2)
    assert shard_map is not None
    view = ShardMapView.read(url)
    ids = [f"doc-{i}" for i in range(200)]
    assert view.version == shard_map.version and view.partitions() == [0, 1]
    assert [view.owner(i) for i in ids] == [shard_map.owner(i) for i in ids]
    assert view.owned(1, ids).tolist() == [shard_map.owner(i) == 1 for i in ids] and view.owned(0, []).size == 0
    assert view.replicas(0) == [] and view.writer(0) is None
    part = ObjectStoreUrl.parse(partition_url(url, shard_map, 0))
    Registration(part, "replica-a", "http://replica-a:8000").beat(make_client(), "replica", 0)
    after = ShardMapView.read(url, view)
    assert after.replicas(0) == ["http://replica-a:8000"] and after.replicas(1) == [] and after.version == view.version
    with pytest.raises(InvalidParameterError, match="no shard map"):
        ShardMapView.read(moto_store.url("no-map-here"))


@pytest.mark.parametrize("kind", ["oversized", "nested"])
def test_a_map_too_large_or_too_deep_is_refused_and_nothing_routes_or_moves_by_it(moto_store: Store, tmp_path: Path,
                                                                                   kind: str) -> None:
    """A shard map on the store is outside input (espn.untrusted): one over MAX_MAP_BYTES or nested
    past the depth rule is refused in one line naming the object and the rule, before any parser
    sees it. A running router keeps routing by the map it read last, a router does not start on
    it, a resharder moves nothing, and the object is left as it is; the good map put back is read
    as before."""
    url = moto_store.url(f"crafted-{kind}")
    shard_map = init_map(url, 2)
    assert shard_map is not None
    where, client = map_url(url), make_client()
    good = client.get_object(Bucket=where.bucket, Key=where.key(MAP_NAME))["Body"].read()
    if kind == "oversized":  # valid JSON, a byte over the limit
        body = good + b" " * (MAX_MAP_BYTES + 1 - len(good))
        rule = rf"refused, (over {MAX_MAP_BYTES} bytes|{MAX_MAP_BYTES + 1} bytes \(at most {MAX_MAP_BYTES}\))"
    else:  # 10 KB, 5,001 levels deep
        body = b'{"pad": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"
        rule = r"refused, JSON nested 5001 levels deep \(at most 64\)"
    ids = [f"doc-{i}" for i in range(500)]
    before = [shard_map.owner(i) for i in ids]

    async def route() -> None:
        routing = MapRouting(url)
        await routing.start()
        client.put_object(Bucket=where.bucket, Key=where.key(MAP_NAME), Body=body)
        with pytest.raises(IndexCorruptError, match=rule) as refused:
            await routing._read()  # what the router's poll does every MAP_POLL_S (it logs the error and goes on)
        message = str(refused.value)
        assert message.startswith(where.url(MAP_NAME)) and "\n" not in message and len(message) < 300, message
        await asyncio.sleep(0.6)  # refresh reads at most every 0.5 s
        await routing.refresh()  # what a request that found a partition moved does: the refusal is swallowed
        assert routing.view is not None and routing.view.version == shard_map.version
        assert [routing.owner(i) for i in ids] == before and [t.partition for t in routing.targets] == [0, 1]
        client.put_object(Bucket=where.bucket, Key=where.key(MAP_NAME), Body=good)
        await routing._read()
        assert [routing.owner(i) for i in ids] == before

    asyncio.run(route())
    client.put_object(Bucket=where.bucket, Key=where.key(MAP_NAME), Body=body)
    with pytest.raises(IndexCorruptError, match=rule):
        ShardMapView.read(url)  # a router starting now: it does not start on this map
    with pytest.raises(IndexCorruptError, match=rule):
        Resharder(url, tmp_path / "work", wait_s=5).run(3)
    listed = client.list_objects_v2(Bucket=where.bucket, Prefix=where.key(""))
    assert sorted(o["Key"] for o in listed.get("Contents", [])) == [where.key(MAP_NAME)]  # no partition made
    assert client.get_object(Bucket=where.bucket, Key=where.key(MAP_NAME))["Body"].read() == body  # left for a look
