"""A running compaction's progress, written beside its lock (live/COMPACT) for any process to
read: `espn stats` and a server's index status say whether a re-fit runs and how far it got."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from ..files.clock import utc_now
from ..files.durable import write_json_atomic
from ..files.locks import lock_is_free

__all__ = ["PROGRESS_FILE", "COMPACTION_LOCK", "Progress", "compaction_progress", "is_running_progress"]

#: What a running compaction reports of itself: kind, the generation it started from,
#: documents written of how many, since when, by which process.
PROGRESS_FILE = "COMPACT.json"
#: The file a compaction holds an exclusive flock on while it runs (one at a time per index).
COMPACTION_LOCK = "COMPACT"


class Progress:
    """Writes a running compaction's progress to live/COMPACT.json (a small atomic write per block
    of documents), for `espn stats` and the server's index status to read from any process."""

    def __init__(self, path: Path, kind: str, generation: int) -> None:
        self.path, self.kind, self.generation, self.started = path, kind, generation, utc_now()
        self(0, 0)

    def __call__(self, done: int, total: int) -> None:
        write_json_atomic(self.path, {"kind": self.kind, "from_generation": self.generation, "documents": total,
                                      "written": done, "started": self.started, "pid": os.getpid()})

    def done(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def is_running_progress(path: Path) -> bool:
    """Whether `path` is the temporary file a running compaction writes its progress through
    (write_json_atomic's `COMPACT.json.tmp`): a writer's crash recovery must leave it, or the
    compaction's next rename fails and the whole compaction with it."""
    return path.name == PROGRESS_FILE + ".tmp" and not lock_is_free(path.parent / COMPACTION_LOCK)


def compaction_progress(live_dir: Path) -> dict[str, Any] | None:
    """The running compaction's progress, None when none runs (its lock is free)."""
    if lock_is_free(live_dir / COMPACTION_LOCK):
        return None
    try:
        return dict(json.loads((live_dir / PROGRESS_FILE).read_text()))
    except (OSError, ValueError):  # not written yet, or being replaced
        return {}
