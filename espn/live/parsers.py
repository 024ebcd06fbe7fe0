"""The parsers of `espn create | delete | compact | refit | stats | snapshot | restore | publish |
shard-map | reshard`, the commands that act on a live index or its partitions (their code: espn.live.commands).

FAISS-free: `espn --help` builds these without loading the writer, and FAISS loads after
logging is configured (its loader's lines show with -v).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from ..choices import DEFAULT_BOW_DTYPE, ENCODER_SPECS, STORAGE_TYPES, TRUST_REMOTE_CODE_HELP
from ..params import FIRST_STAGE_KINDS

__all__ = ["register", "add_wait_option"]

Handler = Callable[[argparse.Namespace], int]

_WAIT_HELP = "seconds to wait for the writer lock, which other writers hold while they publish (default 60)"


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", handler: Handler) -> None:
    """Add the live-index commands to the `espn` subcommands; `handler` runs them (espn.cli's
    dispatch, which imports their code, espn.live.commands, once logging is configured)."""
    _add_create(sub, handler)
    _add_delete(sub, handler)
    _add_compact(sub, handler)
    p = sub.add_parser("refit", help="rewrite a live index's base now, fitting its IVF, token centroids and residual "
                                     "codes on its own documents (writes go on meanwhile)")
    p.add_argument("index", type=Path)
    add_wait_option(p)
    p.set_defaults(handler=handler)
    p = sub.add_parser("stats", help="segments, deletions and drift of a live index, and how its RAM is split (JSON)")
    p.add_argument("index", type=Path)
    p.add_argument("--ram-mib", type=float, metavar="MIB", default=None,
                   help="the RAM the index may use, as `espn serve --ram-mib` takes it: `memory` shows what its "
                        "first stage keeps resident and what the record cache gets (default: espn's default split)")
    p.add_argument("--reader", default=None, help="the reader it is served with (default: posix)")
    p.set_defaults(handler=handler)
    _add_snapshot(sub, handler)
    _add_restore(sub, handler)
    _add_publish(sub, handler)
    _add_shard_map(sub, handler)
    _add_reshard(sub, handler)


def add_wait_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait", type=float, default=60.0, help=_WAIT_HELP)


def _add_create(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", handler: Handler) -> None:
    p = sub.add_parser("create", help="create an empty index that takes writes at once (`espn add`, PUT over HTTP); "
                                      "it is searched exactly while small and fitted on its own documents as it grows")
    p.add_argument("index", type=Path, help="the index directory to create (must not exist)")
    p.add_argument("--encoder", default="minilm", help="one of: " + "; ".join(ENCODER_SPECS))
    p.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)
    p.add_argument("--bow-dtype", choices=STORAGE_TYPES, default=DEFAULT_BOW_DTYPE,
                   help=f"how vectors are stored (default {DEFAULT_BOW_DTYPE}); residual2/residual4 are int8 until "
                        "the index is fitted")
    p.add_argument("--first-stage", choices=FIRST_STAGE_KINDS, default=None,
                   help="the candidate generator once fitted (default: centroids for models without a trained CLS "
                        "vector, else ivf); exact until then")
    p.add_argument("--no-text-index", action="store_true", help="no full-text index (lexical and hybrid search need one)")
    p.add_argument("--bow-dim", type=int, default=None,
                   help="the dimensions its token vectors are projected to once fitted on its own documents (an "
                        "uncentred PCA, as espn index --bow-dim fits on a corpus; default 64 for models whose vectors "
                        "espn projects, none for others; the model's width: none)")
    p.add_argument("--device", help="torch device of the encoder (default: cuda if available)")
    p.set_defaults(handler=handler)


def _add_delete(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", handler: Handler) -> None:
    p = sub.add_parser("delete", help="delete documents of a live index by external id")
    p.add_argument("index", type=Path)
    p.add_argument("ids", nargs="*", help="external document ids")
    p.add_argument("--ids-file", type=Path, help="a file of ids, one per line")
    add_wait_option(p)
    p.set_defaults(handler=handler)


def _add_compact(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", handler: Handler) -> None:
    p = sub.add_parser("compact", help="merge a live index's segments into one, dropping deleted documents")
    p.add_argument("index", type=Path)
    add_wait_option(p)
    p.set_defaults(handler=handler)


def _add_snapshot(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", handler: Handler) -> None:
    p = sub.add_parser("snapshot", help="copy the current generation of an index (served and written or not) "
                                        "to a new directory: a consistent, servable point-in-time copy")
    p.add_argument("index", type=Path)
    p.add_argument("dest", type=Path, help="a new directory (hard links for immutable files where the filesystem allows)")
    p.set_defaults(handler=handler)


def _add_restore(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", handler: Handler) -> None:
    p = sub.add_parser("restore", help="a servable index directory from a snapshot or from object storage "
                                       "(s3://BUCKET/PREFIX), every byte verified")
    p.add_argument("snapshot", help="a snapshot directory, or s3://BUCKET/PREFIX where `espn publish` wrote")
    p.add_argument("dest", type=Path, help="a new directory")
    p.add_argument("--generation", type=int, default=None, help="from object storage: this generation (default: "
                                                                "the newest published)")
    p.set_defaults(handler=handler)


def _add_publish(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", handler: Handler) -> None:
    p = sub.add_parser("publish", help="upload the current generation of an index to object storage "
                                       "(s3://BUCKET/PREFIX; credentials from the AWS_* environment): its files "
                                       "not stored yet, then its record")
    p.add_argument("index", type=Path)
    p.add_argument("url", help="s3://BUCKET/PREFIX (AWS_ENDPOINT_URL for MinIO, Ceph, GCS)")
    p.add_argument("--keep", type=int, default=None, metavar="N",
                   help="then keep only the newest N generations there (and the files they need); default: keep all")
    p.add_argument("--min-age-s", type=float, default=3600.0,
                   help="with --keep: never delete a stored file younger than this (a publish in progress; default 3600)")
    p.set_defaults(handler=handler)


def _add_shard_map(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", handler: Handler) -> None:
    p = sub.add_parser("shard-map", help="write or show the shard map of a partitioned index on object storage "
                                         "(which partition owns each of the 1,024 hash slots)")
    p.add_argument("action", choices=("init", "show"), help="init: the map of a build's partitions (slot s to "
                                                            "partition s mod S); show: the map, writers and replicas")
    p.add_argument("url", help="s3://BUCKET/PREFIX: the map is PREFIX/shard-map.json, partition P's store PREFIX/part-P")
    p.add_argument("--partitions", type=int, default=None, metavar="S",
                   help="init: the build's partition count (a power of two up to 256)")
    p.add_argument("--exists-ok", action="store_true",
                   help="init: a map already there is no error (it is kept as it is: a reshard may have moved it on)")
    p.set_defaults(handler=handler)


def _add_reshard(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", handler: Handler) -> None:
    p = sub.add_parser("reshard", help="move hash slots until S partitions hold them evenly, copying stored records "
                                       "(no model runs) while writes go on")
    p.add_argument("url", help="s3://BUCKET/PREFIX of the shard map")
    p.add_argument("--partitions", type=int, required=True, metavar="S", help="the partition count to reach")
    p.add_argument("--work", type=Path, required=True,
                   help="a local directory for copies of the source partitions (as large as the largest one)")
    p.add_argument("--wait-s", type=float, default=600.0,
                   help="how long a step waits for a writer: a new partition's to start, a target's to take in a "
                        "bundle, a source's to freeze its slots (default 600)")
    p.set_defaults(handler=handler)
