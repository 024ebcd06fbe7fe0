"""A fenced writer's part in a shard map (espn.shard_map): which slots its partition owns, and
what it does in a move (espn.live.replication.reshard drives the moves; writers act on what the
map says, each of its steps leaving a marker beside the map for the resharder to wait on).

- Ownership: a write of an id whose slot another partition owns is WrongPartitionError (421);
  the map is read again first (at most every MAP_RECHECK_S), so a writer that has not yet seen a
  switch does not refuse its new slots for long. A slot its partition is giving away and has
  frozen is SlotsMovingError (503: a second later the router sends it to the new owner).
- Source, `freezing`: from the moment it reads that state it refuses the slots (at admission,
  and again under the writer lock just before a publish), then writes `frozen.json` naming its
  current generation: every write to the slots it ever acknowledged is in that generation.
- Source, `switched`: deletes its copies of the moved documents (one generation; compaction
  drops them later), then writes `dropped.json`.
- Target, `copying` or `freezing`: applies the move's bundles in order (espn.live.replication.moves),
  each as one generation of stored records, then writes `applied-NNNNNN.json`.

    s3://BUCKET/PREFIX/moves/<move>/bundle-NNNNNN.npz (.json)   written by the resharder
    s3://BUCKET/PREFIX/moves/<move>/applied-NNNNNN.json          by the target
    s3://BUCKET/PREFIX/moves/<move>/frozen.json, dropped.json    by the source
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any, Callable, Sequence

import numpy as np

from espn.errors import DocumentNotFoundError, IndexCorruptError, ObjectStoreError, SlotsMovingError, WriteFailedError
from espn.generation.segments import open_view
from espn.index import read_manifest
from espn.partitioning import SLOT_COUNT, WrongPartitionError, slots_of
from espn.shard_map import Move, ShardMap
from espn.store.format import StoreLayout
from espn.untrusted import load_json

from ..checks import NewDocument, WriteLimits, WriteRequest, check_write
from ..writer import IndexWriter
from .cluster import map_url, partition_url, read_map, read_map_if_changed
from .moves import MAX_BUNDLE_BYTES, Bundle, check_sidecar, moving_documents, parse_bundle
from .store import ObjectStoreUrl, naming_failures, put_if, read_object

__all__ = ["SlotKeeper", "MAP_RECHECK_S", "marker", "read_marker", "bundle_numbers"]

log = logging.getLogger(__name__)

#: How often a writer that finds an id's slot not its own reads the map again before refusing.
MAP_RECHECK_S = 0.5
#: Passage lines of a moved document may be as long as the source took (a build has no write limit).
_MOVE_LIMITS = WriteLimits(max_text_chars=1 << 30)


def marker(client: Any, where: ObjectStoreUrl, move: str, name: str, generation: int) -> None:
    """moves/<move>/<name>.json saying `generation`, written once (If-None-Match)."""
    put_if(client, where, f"moves/{move}/{name}.json", json.dumps({"generation": generation}).encode(),
           if_absent=True, content_type="application/json")


def read_marker(client: Any, where: ObjectStoreUrl, move: str, name: str) -> int | None:
    """The generation a marker names, None when it is not there yet."""
    body = read_object(client, where, f"moves/{move}/{name}.json", 4096)
    if body is None:
        return None
    obj = load_json(body, where.url(f"moves/{move}/{name}.json"), max_bytes=4096, error=IndexCorruptError)
    if not isinstance(obj, dict) or not isinstance(obj.get("generation"), int):
        raise IndexCorruptError(f"{where.url(f'moves/{move}/{name}.json')}: not a move marker")
    return int(obj["generation"])


def bundle_numbers(client: Any, where: ObjectStoreUrl, move: str) -> list[int]:
    """The numbers of a move's complete bundles (those with a sidecar), ascending."""
    prefix = where.key(f"moves/{move}/bundle-")
    with naming_failures(f"listing {where.url(f'moves/{move}/')}"):
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=where.bucket, Prefix=prefix)
        names = [obj["Key"][len(prefix):] for page in pages for obj in page.get("Contents", [])]
    return sorted(int(n[:6]) for n in names if len(n) == 11 and n.endswith(".json") and n[:6].isdigit())


class SlotKeeper:
    """The shard map as one writer of one partition sees it. `url`: the map's prefix;
    `publish_url`: this writer's partition store (it finds its partition by it)."""

    def __init__(self, url: str, publish_url: str) -> None:
        self.url, self.where, self.publish_url = url, map_url(url), publish_url.rstrip("/")
        self.shard_map: ShardMap | None = None
        self.etag = ""
        self.partition: int | None = None
        self._owned = np.zeros(SLOT_COUNT, dtype=bool)
        self._frozen = np.zeros(SLOT_COUNT, dtype=bool)
        self._read_at = 0.0
        #: Documents this writer has taken in from moves (stored records, never encoded).
        self.ingested = 0

    def refresh(self, client: Any) -> None:
        """Read the map if it changed (one conditional GET)."""
        found = read_map_if_changed(client, self.where, self.etag) if self.shard_map is not None else \
            read_map(client, self.where)
        self._read_at = time.monotonic()
        if found is None:
            if self.shard_map is None:
                raise WriteFailedError(f"{self.where.url('shard-map.json')}: no shard map there yet (`espn shard-map "
                                       "init`); writes wait for it")
            return
        shard_map, self.etag = found
        mine = [p.id for p in shard_map.partitions
                if partition_url(self.url, shard_map, p.id).rstrip("/") == self.publish_url]
        if not mine:
            raise ObjectStoreError(f"the shard map at {self.url} names no partition stored at {self.publish_url}")
        partition = mine[0]
        frozen = np.zeros(SLOT_COUNT, dtype=bool)
        for move in shard_map.moves:
            if move.source == partition and move.state != "copying":
                frozen[list(move.slots)] = True
        self.shard_map, self.partition = shard_map, partition
        self._owned, self._frozen = shard_map.slots(partition), frozen

    def admit(self, client: Callable[[], Any], doc_ids: Sequence[str]) -> None:
        """WrongPartitionError / SlotsMovingError naming the first id this writer may not take now."""
        if not doc_ids:
            return
        slots = slots_of(np.array([i.encode("utf-8") for i in doc_ids], dtype=bytes))
        if self.shard_map is None or (not self._owned[slots].all() and time.monotonic() - self._read_at > MAP_RECHECK_S):
            try:
                self.refresh(client())
            except ObjectStoreError as exc:  # the store is away: refuse what is not known to be this writer's
                if self.shard_map is None:
                    raise WriteFailedError(f"the shard map at {self.url} cannot be read: {exc}") from exc
        assert self.shard_map is not None  # refresh read it or raised
        foreign = np.flatnonzero(~self._owned[slots])
        if len(foreign):
            slot = int(slots[foreign[0]])
            raise WrongPartitionError(f"id {doc_ids[int(foreign[0])]!r} is in slot {slot}, which partition "
                                      f"{self.shard_map.owners[slot]} owns in the shard map (version "
                                      f"{self.shard_map.version}), not this one ({self.partition}): send writes "
                                      "through `espn route --shard-map`")
        moving = np.flatnonzero(self._frozen[slots])
        if len(moving):
            slot = int(slots[moving[0]])
            move = next(m for m in self.shard_map.moves if slot in m.slots)
            raise SlotsMovingError(f"id {doc_ids[int(moving[0])]!r} is in slot {slot}, which {move.id} is moving to "
                                   f"partition {move.target}; retry in a second")

    # -- a leader's duties in the map's moves ------------------------------------------------
    def tend(self, client: Any, writer: Callable[[], IndexWriter], wait_s: float) -> None:
        """One pass over the moves this partition takes part in (a leader's thread calls it)."""
        self.refresh(client)
        if self.shard_map is None or self.partition is None:
            return
        for move in self.shard_map.moves_of(self.partition):
            if move.source == self.partition and move.state == "freezing":
                self._freeze(client, move, writer(), wait_s)
            elif move.source == self.partition and move.state == "switched":
                self._drop(client, move, writer(), wait_s)
            elif move.target == self.partition and move.state in ("copying", "freezing"):
                self._ingest(client, move, writer(), wait_s)

    def _freeze(self, client: Any, move: Move, writer: IndexWriter, wait_s: float) -> None:
        if read_marker(client, self.where, move.id, "frozen") is not None:
            return
        with writer.locked(wait_s) as current:  # publishes after this one re-check the frozen slots under the lock
            generation = current.number
        marker(client, self.where, move.id, "frozen", generation)
        log.info("%s: slots of %s frozen at generation %d", self.publish_url, move.id, generation)

    def _drop(self, client: Any, move: Move, writer: IndexWriter, wait_s: float) -> None:
        if read_marker(client, self.where, move.id, "dropped") is not None:
            return
        slots = np.zeros(SLOT_COUNT, dtype=bool)
        slots[list(move.slots)] = True
        view = open_view(writer.root)
        try:
            _, ids = moving_documents(view, slots)
        finally:
            view.close()
        generation = writer.current().number
        if len(ids):
            deletes = tuple(raw.decode("utf-8") for raw in ids.tolist())
            outcome = writer.publish([WriteRequest((), deletes)], [None], wait_s, readmit=False)[0]
            if isinstance(outcome, Exception):
                raise outcome
            generation = outcome.generation
        marker(client, self.where, move.id, "dropped", generation)
        log.info("%s: dropped the %d documents %s moved away (generation %d)", self.publish_url, len(ids), move.id,
                 generation)

    def _ingest(self, client: Any, move: Move, writer: IndexWriter, wait_s: float) -> None:
        layout = StoreLayout.from_manifest(read_manifest(writer.root / writer.current().base)["store"])
        for number in bundle_numbers(client, self.where, move.id):
            name = f"applied-{number:06d}"
            if read_marker(client, self.where, move.id, name) is not None:
                continue
            bundle = parse_bundle(self._fetch_bundle(client, move.id, number), self.where.url(
                f"moves/{move.id}/bundle-{number:06d}.npz"), layout)
            generation = self._apply(writer, bundle, move, wait_s)
            self.ingested += len(bundle.documents) if bundle.documents is not None else 0
            marker(client, self.where, move.id, name, generation)
            log.info("%s: %s bundle %d applied (%d documents, %d deletes; generation %d)", self.publish_url, move.id,
                     number, len(bundle.documents) if bundle.documents else 0, len(bundle.deletes), generation)

    def _fetch_bundle(self, client: Any, move: str, number: int) -> bytes:
        stem = f"moves/{move}/bundle-{number:06d}"
        side = read_object(client, self.where, f"{stem}.json", 4096)
        if side is None:
            raise ObjectStoreError(f"{self.where.url(stem + '.json')}: missing")
        info = check_sidecar(side, self.where.url(f"{stem}.json"))
        data = read_object(client, self.where, f"{stem}.npz", min(int(info["bytes"]), MAX_BUNDLE_BYTES))
        if data is None or len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise IndexCorruptError(f"{self.where.url(stem + '.npz')}: missing, or not the bytes its sidecar names; "
                                    "nothing of it was applied")
        return data

    @staticmethod
    def _apply(writer: IndexWriter, bundle: Bundle, move: Move, wait_s: float) -> int:
        """One generation: the bundle's documents upserted as stored, its deletes of ids this index
        holds (and, for the first bundle of a whole copy, every other id it holds in the slots)."""
        documents = bundle.documents
        view = open_view(writer.root)
        try:
            present = []
            for doc_id in bundle.deletes:
                try:
                    view.ids.internal(doc_id)
                    present.append(doc_id)
                except DocumentNotFoundError:
                    pass  # written and deleted at the source between two bundles: never here
            if bundle.replace:
                slots = np.zeros(SLOT_COUNT, dtype=bool)
                slots[list(move.slots)] = True
                upserted = set(documents.ids) if documents is not None else set()
                held = [raw.decode("utf-8") for raw in moving_documents(view, slots)[1].tolist()]
                present += [doc_id for doc_id in held if doc_id not in upserted and doc_id not in present]
        finally:
            view.close()
        upserts = [] if documents is None else [_document(doc_id, line) for doc_id, line in
                                                zip(documents.ids, documents.lines)]
        if not upserts and not present:
            return writer.current().number
        request = check_write(upserts, present, _MOVE_LIMITS)
        outcome = writer.publish([request], [documents], wait_s, readmit=False)[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome.generation


def _document(doc_id: str, line: bytes) -> NewDocument:
    obj = json.loads(line)
    return NewDocument(doc_id, obj.get("text") or "", obj.get("title") or "", obj.get("metadata"))
