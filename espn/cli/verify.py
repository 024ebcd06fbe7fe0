"""`espn verify`: check every file of an index (its base and every delta segment of the
current generation) against the checksums its manifests record."""

from __future__ import annotations

import argparse

from ..segments import open_view

__all__ = ["cmd_verify"]


def cmd_verify(args: argparse.Namespace) -> int:
    view = open_view(args.index, verify="full")  # the base and every delta segment of the current generation
    view.close()
    generation = view.generation
    files = len(view.base.manifest["files"]) + sum(len(s.files) for s in generation.segments) + len(generation.tombstones)
    print(f"{args.index}: {files} files verified, {generation.live_documents} documents"
          + (f" (generation {generation.number})" if generation.number else ""))
    return 0
