"""Retention on object storage: keep the newest generations and the blobs they need."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from espn.errors import InvalidParameterError

from .store import ObjectStoreUrl, make_client, naming_failures, read_record

__all__ = ["Retention", "apply_retention"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Retention:
    records_deleted: int
    blobs_deleted: int
    bytes_deleted: int


def apply_retention(url: str, keep: int, min_age_s: float = 3600.0) -> Retention:
    """Keep the newest `keep` generations on object storage and the blobs they need; delete the rest.

    Records go first (so no restore or follower starts on them), then the blobs no kept record
    names. A blob younger than `min_age_s` is kept whatever: a publish uploads its blobs before
    its record, and they must not vanish in between. A follower fetches the newest generation,
    which is always kept.
    """
    if keep < 1:
        raise InvalidParameterError(f"keep must be at least 1 (the newest generation), got {keep}")
    where, client = ObjectStoreUrl.parse(url), make_client()

    def listing(folder: str) -> list[dict[str, Any]]:
        with naming_failures(f"listing {where.url(folder + '/')}"):
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=where.bucket,
                                                                     Prefix=where.key(folder) + "/")
            return [obj for page in pages for obj in page.get("Contents", [])]

    def delete(key: str) -> None:
        with naming_failures(f"deleting s3://{where.bucket}/{key}"):
            client.delete_object(Bucket=where.bucket, Key=key)

    records = sorted(listing("generations"), key=lambda o: o["Key"])
    kept, dropped = records[-keep:], records[:-keep]
    for obj in dropped:
        delete(obj["Key"])
    needed: set[str] = set()
    for obj in kept:  # a record that cannot be read stops retention before any blob is deleted
        checked = read_record(client, where, obj["Key"].rsplit("/", 1)[-1])
        needed |= {piece.sha256 for piece in checked[1]} if checked is not None else set()
    now = time.time()
    blobs = deleted_bytes = 0
    for obj in listing("blobs"):
        if obj["Key"].rsplit("/", 1)[-1] in needed or now - obj["LastModified"].timestamp() < min_age_s:
            continue
        delete(obj["Key"])
        blobs, deleted_bytes = blobs + 1, deleted_bytes + int(obj["Size"])
    log.info("%s: kept %d generations; deleted %d older records and %d blobs (%d bytes)", url, len(kept), len(dropped),
             blobs, deleted_bytes)
    return Retention(len(dropped), blobs, deleted_bytes)
