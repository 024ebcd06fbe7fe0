"""The cluster as the store holds it: the shard map (espn.shard_map) beside the partitions, each
partition's writer (its lease) and its replicas (member records), read and written here.

    s3://BUCKET/PREFIX/shard-map.json          the map; every write of it is conditional
    s3://BUCKET/PREFIX/<store>/LEASE           partition <store>'s writer (espn.live.replication.lease)
    s3://BUCKET/PREFIX/<store>/members/N.json  one per server of the partition (writer, standby or
                                               follower): its URL, role and generation, rewritten by
                                               that server every few seconds, removed at a clean stop

A router reads all of it (`read_cluster`) and reads it again every few seconds; the map only
when its ETag moved (a conditional GET). Kubernetes Services remain the way to reach a pod;
these records say which pods are there and which one writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import time
from typing import Any

from espn.errors import IndexCorruptError, InvalidParameterError
from espn.shard_map import MAX_MAP_BYTES, ShardMap
from espn.untrusted import load_json

from .lease import LeaseRecord, read_lease
from .store import ObjectStoreUrl, make_client, naming_failures, put_if, read_object, read_object_tagged

__all__ = ["init_map", "describe_cluster", "MAP_NAME", "Member", "Cluster", "map_url", "partition_url", "read_map", "read_map_if_changed",
           "write_map", "member_name", "register", "unregister", "read_members", "read_cluster", "Registration",
           "MEMBER_EVERY_S", "MEMBER_FRESH_S"]

log = logging.getLogger(__name__)

MAP_NAME = "shard-map.json"
#: How often a server rewrites its member record, and how old one may be before a router stops counting on it.
MEMBER_EVERY_S = 5.0
MEMBER_FRESH_S = 60.0
_MAX_MEMBER_BYTES = 4096
_MAX_MEMBERS = 256
_NAME = re.compile(r"[A-Za-z0-9._:@-]{1,100}\Z")


def map_url(url: str) -> ObjectStoreUrl:
    return ObjectStoreUrl.parse(url)


def partition_url(url: str, shard_map: ShardMap, partition: int) -> str:
    """s3://BUCKET/PREFIX/<store> of a partition of the map at `url` (s3://BUCKET/PREFIX)."""
    return f"{url.rstrip('/')}/{shard_map.partition(partition).store}"


def read_map(client: Any, where: ObjectStoreUrl) -> tuple[ShardMap, str] | None:
    """The map and its ETag, None when there is none."""
    found = read_object_tagged(client, where, MAP_NAME, MAX_MAP_BYTES)
    return None if found is None else (ShardMap.parse(found[0], where.url(MAP_NAME)), found[1])


def read_map_if_changed(client: Any, where: ObjectStoreUrl, etag: str) -> tuple[ShardMap, str] | None:
    """The map if its ETag is no longer `etag` (one conditional GET: 304 costs no body), else None."""
    from botocore.exceptions import ClientError

    with naming_failures(f"reading {where.url(MAP_NAME)}"):
        try:
            response = client.get_object(Bucket=where.bucket, Key=where.key(MAP_NAME), IfNoneMatch=etag)
        except ClientError as exc:
            if str(exc.response.get("Error", {}).get("Code")) in ("304", "NotModified"):
                return None
            raise
        body = response["Body"]
        try:
            data = body.read(MAX_MAP_BYTES + 1)
        finally:
            body.close()
    if len(data) > MAX_MAP_BYTES:
        raise IndexCorruptError(f"{where.url(MAP_NAME)}: refused, over {MAX_MAP_BYTES} bytes")
    return ShardMap.parse(data, where.url(MAP_NAME)), str(response.get("ETag", ""))


def write_map(client: Any, where: ObjectStoreUrl, shard_map: ShardMap, etag: str | None) -> str | None:
    """Write the map if it is still at `etag` (None: if there is none yet): its new ETag, or None
    when another write got there first (read it again and decide again)."""
    problem = shard_map.problem()
    if problem:
        raise InvalidParameterError(f"not writing {where.url(MAP_NAME)}: {problem}")
    return put_if(client, where, MAP_NAME, shard_map.to_bytes(), if_match=etag, if_absent=etag is None,
                  content_type="application/json")


@dataclasses.dataclass(frozen=True)
class Member:
    """A server of a partition: its name, the URL it serves at, its role (leader, standby or
    replica), the generation it serves, and when it said so (seconds since the epoch)."""

    name: str
    url: str
    role: str
    generation: int
    at: float

    @classmethod
    def parse(cls, body: bytes, what: str) -> "Member":
        obj = load_json(body, what, max_bytes=_MAX_MEMBER_BYTES, error=IndexCorruptError, finite=True)
        try:
            member = cls(str(obj["name"]), str(obj["url"]), str(obj["role"]), int(obj["generation"]), float(obj["at"]))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise IndexCorruptError(f"{what}: not a member record ({type(exc).__name__}: {exc})") from None
        if not _NAME.match(member.name) or not re.match(r"https?://[^\s/]+\Z", member.url) \
                or member.role not in ("leader", "standby", "replica"):
            raise IndexCorruptError(f"{what}: not a member record (name {member.name[:60]!r}, url "
                                    f"{member.url[:100]!r}, role {member.role[:20]!r})")
        return member


def member_name(url: str) -> str:
    """A member record's name for a server known by its URL alone (a follower): stable across restarts."""
    return "r-" + hashlib.sha256(url.encode()).hexdigest()[:16]


def register(client: Any, where: ObjectStoreUrl, member: Member) -> None:
    """Write (or rewrite) this server's member record under the partition's prefix."""
    put_if(client, where, f"members/{member.name}.json", json.dumps(dataclasses.asdict(member)).encode(),
           content_type="application/json")


def unregister(client: Any, where: ObjectStoreUrl, name: str) -> None:
    with naming_failures(f"deleting {where.url(f'members/{name}.json')}"):
        client.delete_object(Bucket=where.bucket, Key=where.key(f"members/{name}.json"))


def read_members(client: Any, where: ObjectStoreUrl, fresh_s: float = MEMBER_FRESH_S) -> list[Member]:
    """The partition's servers that said they were there within `fresh_s` (by their own clocks:
    a generous bound, the router's retries cover a server gone since)."""
    prefix = where.key("members/")
    with naming_failures(f"listing {where.url('members/')}"):
        listing = client.list_objects_v2(Bucket=where.bucket, Prefix=prefix, MaxKeys=_MAX_MEMBERS)
    members = []
    now = time.time()
    for item in listing.get("Contents", []):
        name = item["Key"][len(prefix):]
        if not name.endswith(".json") or "/" in name:
            continue
        try:
            body = read_object(client, where, f"members/{name}", _MAX_MEMBER_BYTES)
            member = Member.parse(body, where.url(f"members/{name}")) if body is not None else None
        except IndexCorruptError as exc:
            log.warning("%s", exc)  # one bad record leaves only its own server out
            continue
        if member is not None and now - member.at <= fresh_s:
            members.append(member)
    return sorted(members, key=lambda m: m.name)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What a router needs: the map (and its ETag), each partition's writer (its lease, None
    while no writer took it) and its live servers."""

    url: str
    shard_map: ShardMap
    etag: str
    writers: dict[int, LeaseRecord | None]
    members: dict[int, list[Member]]

    def replicas(self, partition: int) -> list[str]:
        """URLs that serve the partition's searches: its followers, else (none registered) its writers."""
        members = self.members.get(partition, [])
        followers = [m.url for m in members if m.role == "replica"]
        return followers or [m.url for m in members]

    def writer_url(self, partition: int) -> str | None:
        lease = self.writers.get(partition)
        return lease.url if lease is not None and lease.url and not lease.released else None


def read_cluster(client: Any, url: str, previous: Cluster | None = None) -> Cluster:
    """The map at `url` (s3://BUCKET/PREFIX; re-read only when its ETag moved since `previous`),
    and every partition's lease and members. InvalidParameterError when there is no map."""
    where = map_url(url)
    found = read_map_if_changed(client, where, previous.etag) if previous is not None else read_map(client, where)
    if found is None and previous is None:
        raise InvalidParameterError(f"{where.url(MAP_NAME)}: no shard map there (`espn shard-map init` writes one)")
    shard_map, etag = found if found is not None else (previous.shard_map, previous.etag)  # type: ignore[union-attr]
    writers: dict[int, LeaseRecord | None] = {}
    members: dict[int, list[Member]] = {}
    for partition in shard_map.partitions:
        if partition.retired:
            continue
        store = ObjectStoreUrl.parse(partition_url(url, shard_map, partition.id))
        lease = read_lease(client, store)
        writers[partition.id] = lease[0] if lease is not None else None
        members[partition.id] = read_members(client, store)
    return Cluster(url, shard_map, etag, writers, members)


class Registration:
    """A server's member record, rewritten at most every MEMBER_EVERY_S (and at once when its role
    changes), removed by `leave` at a clean stop. Nothing when the server advertises no URL."""

    def __init__(self, where: ObjectStoreUrl, name: str, url: str) -> None:
        self.where, self.name, self.url = where, name, url
        self._said: tuple[str, int] | None = None
        self._at = 0.0

    def beat(self, client: Any, role: str, generation: int) -> None:
        if not self.url or (self._said == (role, generation) and time.monotonic() - self._at < MEMBER_EVERY_S):
            return
        register(client, self.where, Member(self.name, self.url, role, generation, time.time()))
        self._said, self._at = (role, generation), time.monotonic()

    def leave(self, client: Any) -> None:
        if self.url and self._said is not None:
            unregister(client, self.where, self.name)
            self._said = None


def init_map(url: str, partitions: int, exists_ok: bool = False) -> ShardMap | None:
    """The shard map of a build's `partitions` partitions (each at URL/part-P), written where none
    is; None when one is there already and `exists_ok`."""
    shard_map = ShardMap.initial(partitions)
    where = map_url(url)
    if write_map(make_client(), where, shard_map, None) is None:
        if exists_ok:
            return None
        raise InvalidParameterError(f"{where.url(MAP_NAME)}: a shard map is there already (`espn shard-map show`)")
    return shard_map


def describe_cluster(url: str) -> dict[str, Any]:
    """The map, each partition's slot count, writer and replicas, and the moves in progress (as JSON)."""
    cluster = read_cluster(make_client(), url)
    shard_map = cluster.shard_map
    partitions = []
    for p in shard_map.partitions:
        writer = cluster.writers.get(p.id)
        partitions.append({"partition": p.id, "store": partition_url(url, shard_map, p.id), "retired": p.retired,
                           "slots": int(shard_map.slots(p.id).sum()),
                           "writer": None if writer is None else {"name": writer.name, "url": writer.url,
                                                                  "epoch": writer.epoch},
                           "members": [dataclasses.asdict(m) for m in cluster.members.get(p.id, [])]})
    return {"map": url, "version": shard_map.version, "partitions": partitions,
            "moves": [{**dataclasses.asdict(m), "slots": len(m.slots)} for m in shard_map.moves]}
