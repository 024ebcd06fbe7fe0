"""What a serving process does once, before its workers start: check every index opens, decide
whether the default is written, clear what killed creations left in the root, restore a new
follower from the store, and load the heavy modules so that forked workers share them."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Optional

from ..errors import EspnError
from ..files.locks import lock_is_free, process_alive
from ..generation.segments import open_view
from ..live.create import remove_leftovers
from ..live.replication.restore import restore_from_store
from ..live.status import read_only_reason
from .config import ServeConfig
from .memory import plan_index_ram

__all__ = ["Startup"]

logger = logging.getLogger(__name__)


class Startup:
    """The once-per-server steps, each a function of the config (see the module doc)."""

    @staticmethod
    def problem(config: ServeConfig) -> Optional[str]:
        """What would make every worker fail at start-up, as one line (None: nothing): a damaged
        index (the current generation of each is opened and checked), a RAM below what an index
        keeps resident, a missing extra."""
        try:
            for name, path in config.indexes.items():
                open_view(path, verify="fast").close()
                plan_index_ram(path, config.index_config(name))
        except (EspnError, ValueError, OSError) as error:
            return str(error)
        if config.index.publish is not None or config.index.follow is not None:
            if importlib.util.find_spec("boto3") is None:  # else every worker's thread would fail on its own
                return "--publish and --follow need boto3: pip install 'espn[s3]'"
        return None

    @staticmethod
    def read_only_reason(index: Path) -> Optional[str]:
        """Why the index cannot be written here (a read-only mount, ...), or None."""
        return read_only_reason(index)

    @staticmethod
    def clear_root(root: Path) -> list[str]:
        """The root made if missing, and cleared of what killed creations and deletions left."""
        root.mkdir(parents=True, exist_ok=True)
        return remove_leftovers(root)

    @staticmethod
    def restore(source: str, index: Path) -> None:
        """A new follower's index, restored from the newest generation in the store."""
        restore_from_store(source, index)

    @staticmethod
    def lock_is_free(path: Path) -> bool:
        """Whether no process holds a lock on `path` (a directory a serving process owns while it lives)."""
        return lock_is_free(path)

    @staticmethod
    def process_alive(pid: int) -> bool:
        """Whether process `pid` exists (espn.files.locks.process_alive)."""
        return process_alive(pid)

    @staticmethod
    def preload() -> None:
        """The library's heavy modules imported (torch, FAISS, the encoders, transformers' model
        code): a parent that imports them once forks workers that share the pages."""
        for module in ("espn.engine.registry", "transformers.modeling_utils"):
            importlib.import_module(module)
