"""`espn verify`: check that the generation on disk is the one the index records (`live/CURRENT`
present wherever live/ holds a generation, naming a record whose number is its own and no newer
one) and every file of it (its base and every delta segment) against the checksums its
manifests record."""

from __future__ import annotations

import argparse
import os

from ..generation.format import check_recorded
from ..generation.segments import open_view

__all__ = ["cmd_verify"]


def cmd_verify(args: argparse.Namespace) -> int:
    if os.path.isdir(args.index):
        check_recorded(args.index)  # a lost live/CURRENT reads as generation 0: never "verified"
    view = open_view(args.index, verify="full")  # the base and every delta segment of the current generation
    view.close()
    generation = view.generation
    files = len(view.base.manifest["files"]) + sum(len(s.files) for s in generation.segments) + len(generation.tombstones)
    print(f"{args.index}: {files} files verified, {generation.live_documents} documents"
          + (f" (generation {generation.number})" if generation.number else ""))
    return 0
