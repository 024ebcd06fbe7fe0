"""`espn create | delete | compact | refit | stats | snapshot | restore | publish | shard-map | reshard`:
the commands that act on a live index or its partitions.

Their parsers are espn.live.parsers (registered into the `espn` command by espn.cli, which
runs these through its dispatch once logging is configured). `espn add`, whose bulk path
encodes a corpus the way the build does, is the build job's (espn_indexing.commands).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Iterator

from espn.encoders import encoder_from_spec
from espn.errors import InvalidParameterError, UsageError
from espn.partitioning import SLOT_COUNT
from espn.store.ram_plan import plan_ram
from espn.text.config import TextConfig

from .create import NewIndex, create_index
from .encoding import documents_encoded
from .live_index import LiveIndex
from .replication.cluster import describe_cluster, init_map
from .replication.publisher import publish
from .replication.reshard import Resharder
from .replication.restore import restore_from_store
from .replication.retention import apply_retention
from .replication.store import is_store_url
from .snapshot import restore, snapshot
from .status import live_stats

__all__ = ["COMMANDS", "iter_ids_file", "print_write", "cmd_create", "cmd_delete", "cmd_compact", "cmd_refit",
           "cmd_stats", "cmd_snapshot", "cmd_restore", "cmd_publish", "cmd_shard_map", "cmd_reshard"]


def iter_ids_file(path: Path) -> Iterator[str]:
    """Ids one per line (blank lines skipped; nothing else is stripped), for `espn delete --ids-file`."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:  # invalid UTF-8 is refused by name later
        for line in f:
            doc_id = line.rstrip("\r\n")
            if doc_id.strip():
                yield doc_id


def print_write(index: Path, what: str, result: Any) -> None:
    print(f"{index}: {what}; generation {result.generation} published")


def cmd_delete(args: argparse.Namespace) -> int:
    if not args.ids and args.ids_file is None:
        raise UsageError("give ids to delete, or --ids-file FILE")
    ids = list(args.ids)
    if args.ids_file is not None:
        ids += list(iter_ids_file(args.ids_file))
    if not ids:
        raise InvalidParameterError(f"--ids-file {args.ids_file}: no ids in it")
    with LiveIndex(args.index) as writer:
        result = writer.apply(deletes=ids, wait_s=args.wait)
    print_write(args.index, f"{len(result.deleted)} deleted", result)
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    # bow_dim None: saved without a projection; the index fits one on its own vectors (espn.live.create).
    encoder = encoder_from_spec(args.encoder, bow_dim=None, device=args.device, trust_remote_code=args.trust_remote_code)
    options = NewIndex(dtype=args.bow_dtype, first_stage=args.first_stage,
                       text_index=None if args.no_text_index else TextConfig(), bow_dim=args.bow_dim)
    create_index(args.index, encoder, options)
    print(f"{args.index}: created empty ({encoder.kind} encoder); it takes writes now (`espn add`, or PUT over HTTP)")
    return 0


def cmd_refit(args: argparse.Namespace) -> int:
    with LiveIndex(args.index) as writer:
        result = writer.refit(wait_s=args.wait)
        live_documents = writer.current().live_documents
    print_write(args.index, f"fitted on its {live_documents} live documents", result)
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    # From a snapshot: writes go on meanwhile and wait only for the swap.
    with LiveIndex(args.index) as writer:
        result = writer.compact(wait_s=args.wait)
        live_documents = writer.current().live_documents
    print_write(args.index, f"compacted ({live_documents} live documents)", result)
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    result = snapshot(args.index, args.dest)
    print(f"{args.dest}: generation {result.generation} of {args.index} ({result.files} files; "
          f"{result.linked_bytes / 1e6:.1f} MB linked, {result.copied_bytes / 1e6:.1f} MB copied)")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    if is_store_url(args.snapshot):
        number = restore_from_store(args.snapshot, args.dest, args.generation)
    else:
        if args.generation is not None:
            raise UsageError("--generation is for object storage; a snapshot holds one generation")
        number = restore(Path(args.snapshot), args.dest).generation
    print(f"{args.dest}: generation {number} restored from {args.snapshot} and verified")
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    if args.keep is not None and args.keep < 1:
        raise InvalidParameterError(f"--keep must be at least 1 (the newest generation), got {args.keep}")
    result = publish(args.index, args.url)
    print(f"{args.url}: generation {result.generation} of {args.index} published ({result.uploaded} files uploaded, "
          f"{result.uploaded_bytes / 1e6:.1f} MB; {result.already_there} already stored)")
    if args.keep is not None:
        kept = apply_retention(args.url, args.keep, args.min_age_s)
        print(f"{args.url}: {kept.records_deleted} older generations and {kept.blobs_deleted} files "
              f"({kept.bytes_deleted / 1e6:.1f} MB) deleted; the newest {args.keep} kept")
    return 0


def cmd_shard_map(args: argparse.Namespace) -> int:
    if args.action == "init":
        if args.partitions is None:
            raise UsageError("shard-map init needs --partitions S (the build's partition count)")
        shard_map = init_map(args.url, args.partitions, exists_ok=args.exists_ok)
        if shard_map is None:
            print(f"{args.url}: a shard map is there already; kept as it is")
            return 0
        print(f"{args.url}: shard map version {shard_map.version}: {args.partitions} partitions, "
              f"{SLOT_COUNT // args.partitions} slots each")
        return 0
    print(json.dumps(describe_cluster(args.url), indent=2))
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    resharder = Resharder(args.url, args.work, wait_s=args.wait_s, announce=lambda line: print(line, flush=True))
    reports = resharder.run(args.partitions)
    for r in reports:
        print(f"{r.move}: {r.slots} slots from partition {r.source} to {r.target}: {r.documents} documents "
              f"({r.vectors} stored vectors), {r.deletes} deletes in {r.bundles} bundles of "
              f"{r.bundle_bytes / 1e6:.1f} MB; {r.seconds:.1f} s ({r.frozen_s:.1f} s frozen)")
    print(f"{args.url}: resharded to {args.partitions} partitions; {resharder.source_bytes / 1e6:.1f} MB fetched "
          "from the sources")
    print(f"documents encoded: {documents_encoded()}")  # stored records are copied: this process runs no model
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    ram_mib = getattr(args, "ram_mib", None)
    if ram_mib is not None and not ram_mib >= 0:
        raise UsageError(f"--ram-mib must be a number of MiB >= 0, got {ram_mib!r}")
    plan = plan_ram(args.index, None if ram_mib is None else int(ram_mib * 2**20), getattr(args, "reader", None))
    print(json.dumps({**live_stats(args.index), "memory": plan.to_json()}, indent=2))
    return 0


#: The live-index commands by name, for espn.cli's dispatch.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "create": cmd_create,
    "delete": cmd_delete,
    "compact": cmd_compact,
    "refit": cmd_refit,
    "stats": cmd_stats,
    "snapshot": cmd_snapshot,
    "restore": cmd_restore,
    "publish": cmd_publish,
    "shard-map": cmd_shard_map,
    "reshard": cmd_reshard,
}
