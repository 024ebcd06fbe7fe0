"""`espn delete | compact | stats | snapshot | restore | publish`: the commands that act on a live index.

`register(sub)` adds them to the `espn` command (espn.cli). `espn add`, whose bulk path
encodes a corpus the way the build does, is the build job's (espn_indexing.cli).

The handlers that need the writer or a segment reader import it when they run, not at the
top of this module: `espn --help` and the parsers stay light, and FAISS loads after logging
is configured (its loader's lines show with -v). What imports here is FAISS-free.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterator

from espn.errors import InvalidParameterError, UsageError

from .replication.store import is_store_url
from .status import live_stats

__all__ = ["register", "iter_ids_file", "add_wait_option", "print_write"]

_WAIT_HELP = "seconds to wait for the writer lock, which other writers hold while they publish (default 60)"


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add the live-index commands to the `espn` subcommands."""
    _add_delete(sub)
    _add_compact(sub)
    p = sub.add_parser("stats", help="segments, deletions and drift of a live index (JSON)")
    p.add_argument("index", type=Path)
    p.set_defaults(handler=cmd_stats)
    _add_snapshot(sub)
    _add_restore(sub)
    _add_publish(sub)


def add_wait_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait", type=float, default=60.0, help=_WAIT_HELP)


def _add_delete(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("delete", help="delete documents of a live index by external id")
    p.add_argument("index", type=Path)
    p.add_argument("ids", nargs="*", help="external document ids")
    p.add_argument("--ids-file", type=Path, help="a file of ids, one per line")
    add_wait_option(p)
    p.set_defaults(handler=cmd_delete)


def _add_compact(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("compact", help="merge a live index's segments into one, dropping deleted documents")
    p.add_argument("index", type=Path)
    add_wait_option(p)
    p.set_defaults(handler=cmd_compact)


def _add_snapshot(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("snapshot", help="copy the current generation of an index (served and written or not) "
                                        "to a new directory: a consistent, servable point-in-time copy")
    p.add_argument("index", type=Path)
    p.add_argument("dest", type=Path, help="a new directory (hard links for immutable files where the filesystem allows)")
    p.set_defaults(handler=cmd_snapshot)


def _add_restore(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("restore", help="a servable index directory from a snapshot or from object storage "
                                       "(s3://BUCKET/PREFIX), every byte verified")
    p.add_argument("snapshot", help="a snapshot directory, or s3://BUCKET/PREFIX where `espn publish` wrote")
    p.add_argument("dest", type=Path, help="a new directory")
    p.add_argument("--generation", type=int, default=None, help="from object storage: this generation (default: "
                                                                "the newest published)")
    p.set_defaults(handler=cmd_restore)


def _add_publish(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("publish", help="upload the current generation of an index to object storage "
                                       "(s3://BUCKET/PREFIX; credentials from the AWS_* environment): its files "
                                       "not stored yet, then its record")
    p.add_argument("index", type=Path)
    p.add_argument("url", help="s3://BUCKET/PREFIX (AWS_ENDPOINT_URL for MinIO, Ceph, GCS)")
    p.add_argument("--keep", type=int, default=None, metavar="N",
                   help="then keep only the newest N generations there (and the files they need); default: keep all")
    p.add_argument("--min-age-s", type=float, default=3600.0,
                   help="with --keep: never delete a stored file younger than this (a publish in progress; default 3600)")
    p.set_defaults(handler=cmd_publish)


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
    from .live_index import LiveIndex  # FAISS: see the module's docstring

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


def cmd_compact(args: argparse.Namespace) -> int:
    from .live_index import LiveIndex  # FAISS: see the module's docstring

    # From a snapshot: writes go on meanwhile and wait only for the swap.
    with LiveIndex(args.index) as writer:
        result = writer.compact(wait_s=args.wait)
        live_documents = writer.current().live_documents
    print_write(args.index, f"compacted ({live_documents} live documents)", result)
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    from .snapshot import snapshot  # FAISS: see the module's docstring

    result = snapshot(args.index, args.dest)
    print(f"{args.dest}: generation {result.generation} of {args.index} ({result.files} files; "
          f"{result.linked_bytes / 1e6:.1f} MB linked, {result.copied_bytes / 1e6:.1f} MB copied)")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from .replication.restore import restore_from_store  # FAISS: see the module's docstring
    from .snapshot import restore

    if is_store_url(args.snapshot):
        number = restore_from_store(args.snapshot, args.dest, args.generation)
    else:
        if args.generation is not None:
            raise UsageError("--generation is for object storage; a snapshot holds one generation")
        number = restore(Path(args.snapshot), args.dest).generation
    print(f"{args.dest}: generation {number} restored from {args.snapshot} and verified")
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    from .replication.publisher import publish  # FAISS: see the module's docstring
    from .replication.retention import apply_retention

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


def cmd_stats(args: argparse.Namespace) -> int:
    print(json.dumps(live_stats(args.index), indent=2))
    return 0
