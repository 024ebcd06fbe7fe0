"""Opening one generation for search: its arrays, its reader, its pools, its side indexes.

The Searchers of one live-index base share what does not change between generations (the
reader of embeddings.bin, the prefetch pool, the base's centroid index): those close with
the base (`espn.generation.segments.LiveView.shared`). What a generation opens for itself (its text
index, a reader that cannot follow appends) closes with its Searcher.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

import numpy as np

from ..ann import bitmap_selector, list_sizes, load_ivf
from ..encoders import Encoder
from ..errors import InvalidParameterError
from ..first_stage.centroids import FIRST_STAGE_DIR, FirstStageConfig
from ..index import DocStore, IdMap, IndexDirectory
from ..metadata import MetadataColumns
from ..prefetch import PrefetchModel
from ..generation.segments import LiveView, RecordTable
from ..store import Reader, default_reader_name, open_reader
from ..store.ram_plan import plan_ram
from ..store.format import StoreLayout
from ..store.projection import base_projection
from .centroid_stage import open_centroids
from .context import SearchContext
from .lexical import open_text_index

__all__ = ["GenerationResources", "open_context"]


class GenerationResources:
    """What one Searcher holds: what it owns closes with it (`close`); what it shares with the
    other generations over its live-index base closes with the last of them."""

    def __init__(self, view: LiveView | None) -> None:
        self.view = view
        self._owned: list[Callable[[], None]] = []

    def own(self, close: Callable[[], None]) -> None:
        self._owned.append(close)

    def shared(self, key: str, make: Callable[[], Any], close: Callable[[Any], None]) -> Any:
        """One object for every generation over this live-index base (closed with the base),
        or this Searcher's own without a view."""
        if self.view is not None:
            return self.view.shared.attached(key, make, close)
        value = make()
        self.own(lambda: close(value))
        return value

    def close(self) -> None:
        """Close what this generation owns, last opened first (idempotent)."""
        owned, self._owned = self._owned, []
        for close in reversed(owned):
            close()


def open_context(index: IndexDirectory, view: LiveView | None, encoder: Encoder | None,
                 resources: GenerationResources, reader_name: str | None, reader_options: Mapping[str, Any],
                 device: str, prefetch_threads: int, early_rerank: bool, min_hidden_ms: float) -> SearchContext:
    """The SearchContext of `view` (a live-index generation; `index` is its base), or of the
    index alone without one. What it opens is registered with `resources`."""
    manifest = index.manifest
    records, ann, ids, docs, live = _generation_arrays(index, view)
    layout = StoreLayout.from_manifest(manifest["store"], index.path)
    reader = _open_reader(resources, index, records, layout, reader_name, dict(reader_options), device)
    if live is not None:  # deleted and replaced documents: a record cache drops theirs
        reader.forget(np.flatnonzero(~live))
    score = manifest["score"]
    pool = resources.shared("prefetch-pool", lambda: ThreadPoolExecutor(
        max_workers=prefetch_threads, thread_name_prefix="espn-prefetch"), lambda pool: pool.shutdown(wait=True))
    text = open_text_index(index.path, manifest, view)
    if text is not None:
        resources.own(text.close)
    first_stage = FirstStageConfig.from_manifest(manifest.get("first_stage"))
    centroids = (open_centroids(resources.shared, index.path, view, records, reader)
                 if (index.path / FIRST_STAGE_DIR).is_dir() else None)
    if first_stage.uses_centroids and centroids is None:
        raise InvalidParameterError(f"{index.path}: the manifest's first stage is {first_stage.kind!r} "
                                    f"but the index has no {FIRST_STAGE_DIR}/ (rebuild it)")
    return SearchContext(
        index=index, view=view, manifest=manifest, layout=layout, records=records, ann=ann, ids=ids, docs=docs, live=live,
        # The live bitmap is packed for FAISS once per generation, not once per search.
        live_selector=None if live is None else bitmap_selector(live),
        live_count=len(records) if live is None else int(np.count_nonzero(live)),
        list_sizes=list_sizes(ann), reader=reader, weight=float(score["w"]),
        bow_reduction=score.get("bow_reduction", "mean"), encoder=encoder, tokenizer_lock=threading.Lock(),
        pool=pool, prefetch=PrefetchModel(min_hidden_ms), early_rerank=early_rerank,
        metadata=view.metadata if view is not None else MetadataColumns.open(index.path, manifest),
        text=text, first_stage=first_stage, centroids=centroids,
        projection=base_projection(index.path, manifest["store"]))


def _generation_arrays(index: IndexDirectory, view: LiveView | None) -> tuple[Any, ...]:
    """records, ann, ids, docs and the live bitmap of the generation (or of the index alone)."""
    if view is not None:
        return view.records, view.ann, view.ids, view.docs, view.live
    records = index.load_array("records.npy")
    ann = load_ivf(index.file("ann.faiss"))
    if ann.ntotal != index.num_documents or len(records) != index.num_documents:
        raise InvalidParameterError(f"{index.path}: ann/records/manifest disagree on the document count")
    ids = IdMap(index.load_array("ids.npy"), index.load_array("ids_sorted.npy"))
    docs = DocStore(index.file("docs.jsonl"), index.load_array("docs_offsets.npy"))
    return records, ann, ids, docs, None


def _open_reader(resources: GenerationResources, index: IndexDirectory, records: np.ndarray | RecordTable,
                 layout: StoreLayout, name: str | None, options: dict[str, Any], device: str) -> Reader:
    """The reader of embeddings.bin. The Searchers of one live-index base share one: a newer
    generation only extends its records table (the rows of older doc numbers never change),
    so a write costs no new descriptors, rings or threads. Readers that hold a copy or a
    map of the file (memory, mmap) cannot follow appends: there each generation has its own.

    With the option `ram_mib` (None: espn's default split) the index's RAM is planned
    (`espn.store.ram_plan`): the record cache gets what the first stage leaves, unless
    `record_cache_mb` says otherwise, and the reader reports the plan (`describe()["ram"]`)."""
    name = name or default_reader_name(device)
    plan = None
    if "ram_mib" in options:
        ram_mib = options.pop("ram_mib")
        plan = plan_ram(index.path, None if ram_mib is None else int(ram_mib * 2**20), name)
        if plan.record_cache_bytes and options.get("record_cache_mb") is None:
            options["record_cache_mb"] = plan.record_cache_mb

    def make() -> Reader:
        opened = open_reader(name, index.file("embeddings.bin"), records, layout,  # type: ignore[arg-type]
                             device=device, **options)
        opened.ram_plan = None if plan is None else plan.to_json()
        return opened

    reader: Reader = resources.shared("reader", make, lambda r: r.close())
    if reader.extend_records(records):  # type: ignore[arg-type]  # a RecordTable reads like one
        return reader
    reader = make()
    resources.own(reader.close)
    return reader
