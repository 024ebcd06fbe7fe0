"""`espn reshard`: hash slots moved between partitions by copying stored records, while writes go on.

No model runs: the documents of the moving slots are read back from the source partition's
published records (espn.live.replication.moves: CLS and stored BOW vectors, passage and metadata
lines) and taken in by the target's writer as stored vectors, which it assigns to its own IVF
lists with its quantizer and indexes in its full-text index. The resharder is a client of the
store only: it follows the source's published generations in a local copy (a follower's
fetch), writes bundles, and moves the shard map (espn.shard_map) through each move's states,
each by one conditional write; the writers do their part when they read it
(espn.live.replication.slots), and the router follows the map.

One move, while the source keeps taking writes to its slots:
1. `copying`: a bundle of every document of the slots, then bundles of what changed since
   (new or replaced documents, deleted ids), round after round, until a round is small;
2. `freezing`: the source refuses writes to the slots (503 `slots_moving`, seconds) and names
   the generation that holds every write to them it acknowledged; the last bundle catches
   the target up to it;
3. `switched`: one conditional write of the map gives the slots to the target; the source
   deletes its copies (its compaction drops them later) and the move leaves the map.

A new partition (a split) starts as a copy of a source's published generation with every
document deleted: the same encoder, quantizer and codecs, no model run; its writer
(`espn serve EMPTY_DIR --publish s3://.../part-N --shard-map ...`) restores it and takes the
moves' bundles. Merging back moves every slot of the highest partitions to the others and
marks them retired.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from espn.errors import InvalidParameterError, ObjectStoreError
from espn.generation.format import read_current
from espn.generation.segments import open_view
from espn.partitioning import SLOT_COUNT
from espn.shard_map import ShardMap, plan_moves

from ..live_index import LiveIndex
from ..snapshot import snapshot
from .cluster import map_url, partition_url, read_map, write_map
from .follower import Follower
from .lease import read_lease
from .moves import BUNDLE_DOCUMENTS, bundle_bytes, moving_documents, read_stored, sidecar
from .publisher import publish
from .restore import restore_from_store
from .slots import bundle_numbers, read_marker
from .store import ObjectStoreUrl, is_missing, make_client, naming_failures, pieces_of, put_if

__all__ = ["MoveReport", "Resharder"]

log = logging.getLogger(__name__)

#: A catch-up round this small (documents) is the last before the slots freeze.
CATCH_UP_DOCUMENTS = 200
#: Catch-up rounds before the slots freeze whatever their size.
MAX_ROUNDS = 5


@dataclasses.dataclass
class MoveReport:
    """What one move copied: documents and deletes sent, their stored vectors, bundles and their
    bytes, how long each phase took."""

    move: str
    source: int
    target: int
    slots: int
    documents: int = 0
    deletes: int = 0
    vectors: int = 0
    bundles: int = 0
    bundle_bytes: int = 0
    rounds: int = 0
    frozen_s: float = 0.0
    seconds: float = 0.0


@dataclasses.dataclass
class _Sent:
    """What the target holds of the moving slots: ids (sorted) and, for each, which stored copy
    (the source's base and doc number) was sent."""

    ids: np.ndarray
    keys: np.ndarray
    base: str


class Resharder:
    """Reshards the partitions of the shard map at `url` (s3://BUCKET/PREFIX), working in `work`
    (local copies of the source partitions). `wait_s`: how long a step waits for a writer (a new
    partition's to start, a target's to apply a bundle, a source's to freeze)."""

    def __init__(self, url: str, work: Path, *, wait_s: float = 600.0, poll_s: float = 0.5,
                 bundle_documents: int = BUNDLE_DOCUMENTS, announce: Callable[[str], None] = log.info) -> None:
        self.url, self.where, self.work = url.rstrip("/"), map_url(url), Path(work)
        self.wait_s, self.poll_s, self.bundle_documents, self.announce = wait_s, poll_s, bundle_documents, announce
        self.client = make_client()
        self.reports: list[MoveReport] = []
        self.source_bytes = 0

    # -- the whole reshard ------------------------------------------------------------------
    def run(self, partitions: int) -> list[MoveReport]:
        """Move slots until `partitions` partitions hold them evenly."""
        self.work.mkdir(parents=True, exist_ok=True)
        for unfinished in self._map().moves:  # what a stopped run left: finished first, from its state
            self.announce(f"{unfinished.id} ({unfinished.state}) was left by an earlier run: finishing it")
            self.move(list(unfinished.slots), unfinished.source, unfinished.target, unfinished.id)
        shard_map = self._map()
        moves = plan_moves(shard_map, partitions)
        known = {p.id for p in shard_map.partitions}
        for target in sorted({t for _, _, t in moves} - known):
            self.create_partition(target, next(src for _, src, t in moves if t == target))
        for slots, source, target in moves:
            self.move(slots, source, target)
        for partition in self._map().partitions:
            if not partition.retired and not self._map().slots(partition.id).any():
                self._update(lambda m, p=partition.id: m.retired(p))  # type: ignore[misc]
                self.announce(f"partition {partition.id} holds no slot any more: retired (stop its servers)")
        return self.reports

    def _map(self) -> ShardMap:
        found = read_map(self.client, self.where)
        if found is None:
            raise InvalidParameterError(f"{self.where.url('shard-map.json')}: no shard map (`espn shard-map init`)")
        return found[0]

    def _update(self, change: Callable[[ShardMap], ShardMap]) -> ShardMap:
        """One conditional write of the map: `change` applied to what it holds now (read again and
        applied again when another write got there first)."""
        for _ in range(20):
            found = read_map(self.client, self.where)
            if found is None:
                raise InvalidParameterError(f"{self.where.url('shard-map.json')}: the shard map is gone")
            new = change(found[0])
            if write_map(self.client, self.where, new, found[1]) is not None:
                return new
            time.sleep(self.poll_s)
        raise ObjectStoreError(f"{self.where.url('shard-map.json')}: changed under 20 conditional writes in a row")

    # -- a new partition -------------------------------------------------------------------
    def create_partition(self, partition: int, source: int) -> None:
        """Partition `partition`: a copy of `source`'s newest generation with every document
        deleted, published to its own store (the blobs copied inside the store); then in the map."""
        shard_map = self._map()
        store = f"part-{partition}"
        url = f"{self.url}/{store}"
        copy = self._source_copy(source, shard_map)
        seed = self.work / f"seed-{partition}"
        shutil.rmtree(seed, ignore_errors=True)
        snapshot(copy, seed)
        with LiveIndex(seed) as writer:
            view = open_view(seed)
            try:
                _, ids = moving_documents(view, np.ones(SLOT_COUNT, dtype=bool))
            finally:
                view.close()
            writer.apply(deletes=[raw.decode("utf-8") for raw in ids.tolist()])
        self._copy_blobs(partition_url(self.url, shard_map, source), url, seed)
        publish(seed, url)
        shutil.rmtree(seed)
        new = self._update(lambda m: m.with_partition(store)[0])
        if new.partition(partition).store != store:
            raise ObjectStoreError(f"the shard map gave {store} another id than {partition}: reshard again")
        self.announce(f"partition {partition} created at {url} from partition {source}'s base: start its writer "
                      f"(espn serve DIR --publish {url} --shard-map {self.url}); waiting up to {self.wait_s:.0f} s")
        self._until(lambda: (read_lease(self.client, ObjectStoreUrl.parse(url)) or (None,))[0] is not None,
                    f"a writer of partition {partition} to take its lease")

    def _copy_blobs(self, source_url: str, target_url: str, index: Path) -> None:
        """The blobs of `index`'s current generation that the source's store holds, copied inside
        the store (managed: multipart for a large one); the publish then uploads only the rest."""
        from botocore.exceptions import ClientError  # boto3 is an optional extra (espn[s3])

        source, target = ObjectStoreUrl.parse(source_url), ObjectStoreUrl.parse(target_url)
        for piece in {p.sha256: p for p in pieces_of(index, read_current(index))}.values():
            name = f"blobs/{piece.sha256}"
            with naming_failures(f"copying {source.url(name)} to {target.url(name)}"):
                try:
                    self.client.copy({"Bucket": source.bucket, "Key": source.key(name)}, target.bucket, target.key(name))
                except ClientError as exc:
                    if not is_missing(exc):  # a blob the source lacks (the deletes' own files) is uploaded
                        raise

    def _source_copy(self, source: int, shard_map: ShardMap) -> Path:
        """A local copy of `source`'s newest published generation (restored once, then followed)."""
        url = partition_url(self.url, shard_map, source)
        copy = self.work / f"source-{source}"
        if not copy.exists():
            restore_from_store(url, copy)
            self.source_bytes += sum(f.stat().st_size for f in copy.rglob("*") if f.is_file())
        else:
            before = sum(f.stat().st_size for f in copy.rglob("*") if f.is_file())
            Follower(url, copy).poll_once()
            self.source_bytes += max(0, sum(f.stat().st_size for f in copy.rglob("*") if f.is_file()) - before)
        return copy

    # -- one move --------------------------------------------------------------------------
    def move(self, slots: list[int], source: int, target: int, resume: str | None = None) -> MoveReport:
        """One move (see the module doc); `resume`: the id of a move in the map to go on with
        from its state (a copy starts again from the whole slots: bundles replace what is there)."""
        started = time.monotonic()
        if resume is None:
            shard_map = self._update(lambda m: m.with_move(slots, source, target)[0])
            move = next(m for m in shard_map.moves if m.slots == tuple(sorted(slots)))
        else:
            move = self._map().move(resume)
        report = MoveReport(move.id, source, target, len(slots))
        report.bundles = max(bundle_numbers(self.client, self.where, move.id), default=0)
        self.reports.append(report)
        self.announce(f"{move.id}: {len(slots)} slots from partition {source} to {target}: {move.state}")
        mask = np.zeros(SLOT_COUNT, dtype=bool)
        mask[slots] = True
        sent = _Sent(np.zeros(0, dtype="S1"), np.zeros(0, np.int64), "")
        for _ in range(MAX_ROUNDS if move.state == "copying" else 0):  # the whole slots, then what changed
            sent, changed = self._round(move.id, source, mask, sent, report)
            report.rounds += 1
            if changed <= CATCH_UP_DOCUMENTS:
                break
        frozen_at = time.monotonic()
        if move.state != "switched":
            if move.state == "copying":
                self._update(lambda m: m.with_state(move.id, "freezing"))
            self.announce(f"{move.id}: freezing: partition {source} stops taking writes to the slots")
            generation = self._until(lambda: read_marker(self.client, self.where, move.id, "frozen"),
                                     f"partition {source} to freeze the slots of {move.id}")
            self._round(move.id, source, mask, sent, report, at_least=generation)
            self._update(lambda m: m.with_state(move.id, "switched"))  # the one write that gives the slots away
        report.frozen_s = time.monotonic() - frozen_at
        self.announce(f"{move.id}: switched to partition {target} ({report.frozen_s:.1f} s frozen)")
        self._until(lambda: read_marker(self.client, self.where, move.id, "dropped"),
                    f"partition {source} to drop the documents of {move.id}")
        self._update(lambda m: m.without_move(move.id))
        report.seconds = time.monotonic() - started
        return report

    def _round(self, move: str, source: int, mask: np.ndarray, sent: _Sent, report: MoveReport,
               at_least: int | None = None) -> tuple[_Sent, int]:
        """Bring the target to the source's newest published generation (at least `at_least`)
        for the moving slots: one or more bundles, each awaited; (what it now holds, documents sent)."""
        copy = self._source_copy(source, self._map())
        while at_least is not None and read_current(copy).number < at_least:
            time.sleep(self.poll_s)
            copy = self._source_copy(source, self._map())
        view = open_view(copy)
        try:
            numbers, ids = moving_documents(view, mask)
            keys = numbers
            base = view.generation.base
            upsert, deletes = _diff(sent, ids, keys, base)
            changed = int(upsert.sum()) + len(deletes)
            whole = len(sent.ids) == 0 and not sent.base  # the first round: a whole copy of the slots
            for at in range(0, max(int(upsert.sum()), 1 if len(deletes) or whole else 0), self.bundle_documents):
                chosen = numbers[upsert][at: at + self.bundle_documents]
                documents = read_stored(view, chosen) if len(chosen) else None
                self._send(move, documents, deletes if at == 0 else [], view.generation.number, report,
                           replace=whole and at == 0)
        finally:
            view.close()
        order = np.argsort(ids, kind="stable")
        return _Sent(ids[order], keys[order], base), changed

    def _send(self, move: str, documents: Any, deletes: list[str], generation: int, report: MoveReport,
              replace: bool = False) -> None:
        number = report.bundles + 1
        data = bundle_bytes(documents, deletes, replace)
        stem = f"moves/{move}/bundle-{number:06d}"
        n = len(documents) if documents is not None else 0
        put_if(self.client, self.where, f"{stem}.npz", data)
        put_if(self.client, self.where, f"{stem}.json", sidecar(data, n, len(deletes), generation), if_absent=True,
               content_type="application/json")
        report.bundles, report.bundle_bytes = number, report.bundle_bytes + len(data)
        report.documents, report.deletes = report.documents + n, report.deletes + len(deletes)
        report.vectors += int(documents.counts.sum()) if documents is not None else 0
        self._until(lambda: read_marker(self.client, self.where, move, f"applied-{number:06d}"),
                    f"the target of {move} to apply bundle {number}")

    def _until(self, check: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            value = check()
            if value is not None and value is not False:
                return value
            time.sleep(self.poll_s)
        raise ObjectStoreError(f"waited {self.wait_s:.0f} s for {what}; the reshard stopped there (run it again to "
                               "go on from the map as it stands)")


def _diff(sent: _Sent, ids: np.ndarray, keys: np.ndarray, base: str) -> tuple[np.ndarray, list[str]]:
    """What the target lacks: a mask over `ids` of documents to (re)send (new, or another stored
    copy than the one sent: a replacement; all of them after a base rewrite renumbered the
    source), and the sent ids no longer live."""
    width = max(ids.dtype.itemsize, sent.ids.dtype.itemsize, 1)
    ids, known = ids.astype(f"S{width}"), sent.ids.astype(f"S{width}")
    if len(known) == 0 or base != sent.base:
        upsert = np.ones(len(ids), dtype=bool)
    else:
        at = np.minimum(np.searchsorted(known, ids), len(known) - 1)
        upsert = ~((known[at] == ids) & (sent.keys[at] == keys))
    gone = known[~np.isin(known, ids)]
    return upsert, [raw.decode("utf-8") for raw in gone.tolist()]
