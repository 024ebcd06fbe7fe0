"""The full-text index kept live: a `SideIndex` (espn.live.side_index) that moves with every generation.

Each write applies its adds (title and text, at their doc numbers) and its tombstones
(deleted and replaced doc numbers) to a Tantivy work directory restored from the previous
generation's text index, and publishes the result as `live/text-NNNNNN/` (hard links:
segment files never change) before the generation record names it. So a generation is
visible with both sides or neither: a crash before the record leaves an unpublished
`text-NNNNNN` that recovery removes, and the next writer restores its work directory from
the published one, whatever the crashed writer had committed there.

Compaction: a merge of deltas keeps every doc number, so the text side stays as it was; a
base rewrite renumbers everything, so the new base gets a text index of its own, built
from its passages before the swap (without the writer lock), and the swap adds what was
carried over onto it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from espn.files.crash_points import checkpoint
from espn.index import read_manifest
from ..generation.format import LIVE_DIR, read_current
from espn.text.config import TextConfig
from espn.text.directory import install_text_index, passages
from espn.text.engine import TextDocument, TextWriter

from .encoding import EncodedDocuments
from .side_index import SideIndex, SwapSource
from .staging import Staging

__all__ = ["TextSide", "text_config_of", "own_side_indexes"]

log = logging.getLogger(__name__)


def text_config_of(base: Path) -> TextConfig | None:
    """The analyzer of the base's full-text index, None when the base has none (or lists none of its files)."""
    manifest = read_manifest(base)
    section = manifest.get("text")
    if section is None or "text/meta.json" not in manifest.get("files", {}):
        return None
    return TextConfig.from_json(section.get("analyzer", {}))


def own_side_indexes(root: Path) -> list[SideIndex]:
    """The side indexes the index at `root` has: its full-text index, when its base has one."""
    config = text_config_of(root / read_current(root).base)
    return [] if config is None else [TextSide(config)]


class TextSide:
    """`SideIndex` "text": the generation's entry is {"directory": "text-NNNNNN", "files": {...}}.

    The engine's work directory is kept between writes while each write starts from the
    generation this side published last (one process writing, the usual case); when another
    process (a second server worker) published since, or a publish never became a generation,
    it is restored from the generation the write builds on.
    """

    name = "text"

    def __init__(self, config: TextConfig) -> None:
        self.config = config
        self._stage: Staging | None = None
        self._builds_on: Path | None = None  # the published directory the writer's state equals

    def on_write(self, live_dir: Path, number: int, previous: Mapping[str, Any] | None, first: int,
                 documents: EncodedDocuments | None, tombstones: np.ndarray) -> Mapping[str, Any]:
        adds = [] if documents is None else [_document(first + i, line) for i, line in enumerate(documents.lines)]
        return self._publish(live_dir, number, self._published_dir(live_dir, previous), previous, adds, tombstones)

    def on_rewrite(self, base: Path) -> None:
        install_text_index(base, self.config)

    def on_swap(self, live_dir: Path, number: int, previous: Mapping[str, Any] | None, renumber: Any,
                source: SwapSource | None = None) -> Mapping[str, Any]:
        if source is None:  # a merge of deltas: the numbering and so the text side stay
            return dict(previous or {})
        adds = [TextDocument(first + doc.doc_number, doc.title, doc.text)
                for first, directory in sorted(source.carried.items()) for doc in passages(directory)]
        try:
            return self._publish(live_dir, number, source.base / "text", None, adds, source.deleted)
        finally:
            self.close()  # compactions are rare: their engine writer is not kept

    def close(self) -> None:
        self._builds_on = None
        if self._stage is not None:
            self._stage.close()
            self._stage = None

    def _published_dir(self, live_dir: Path, previous: Mapping[str, Any] | None) -> Path:
        if previous and previous.get("directory"):
            return live_dir / previous["directory"]
        return _base_of(live_dir) / "text"

    def _writer_from(self, live_dir: Path, published: Path) -> TextWriter:
        """An engine writer whose state is `published`: the work directory is reused when it
        holds exactly that (this side published it last), restored from it otherwise."""
        if self._stage is None or self._stage.path.parent != live_dir:
            self.close()
            # A locked staging directory: recovery leaves it while this process lives, removes it after.
            self._stage = Staging.under_lock(live_dir, "text")
        return TextWriter(self._stage.path / "work", published, self.config, restore=self._builds_on != published)

    def _publish(self, live_dir: Path, number: int, published: Path, previous: Mapping[str, Any] | None,
                 adds: Sequence[TextDocument], deletes: np.ndarray) -> dict[str, Any]:
        name = f"text-{number:06d}"
        writer = self._writer_from(live_dir, published)
        self._builds_on = None  # until this publish is done
        try:
            try:
                writer.apply(adds, deletes)
            finally:
                # Closing waits for the engine's merges: the work directory then changes no more, so
                # the publish (and its collection of dead files) never races a merge in flight.
                writer.close()
            known = {path.split("/", 1)[1]: entry for path, entry in ((previous or {}).get("files") or {}).items()}
            files = writer.publish(live_dir / name, known)
        except BaseException:
            # A failed write keeps nothing: its work directory (a copy of the text index, on a full
            # disk the space it took) goes now; the next write restores one from what is published.
            self.close()
            raise
        self._builds_on = live_dir / name
        checkpoint("text-published")
        return {"directory": name, "files": {f"{name}/{f}": e for f, e in files.items()}}


def _document(number: int, line: bytes) -> TextDocument:
    obj = json.loads(line)
    return TextDocument(number, obj.get("title") or "", obj.get("text") or "")


def _base_of(live_dir: Path) -> Path:
    """The current base directory (the writer calls us under its lock, before the new record)."""
    root = live_dir.parent
    if live_dir.name != LIVE_DIR:
        raise ValueError(f"{live_dir}: not an index's {LIVE_DIR} directory")
    return root / read_current(root).base
