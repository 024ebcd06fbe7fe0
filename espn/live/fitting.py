"""What a base's trained parts are fitted on, and the one step that fits them.

Every base is written the same way (a build, a compaction's rewrite, a re-fit, a creation):
its records, ids, passages and a temporary table of its CLS vectors first, then `fit_base`,
which makes what is trained, from the base's own documents only:

- the IVF over CLS vectors, its list count from the documents (`espn.ann.default_nlist`);
- the token centroids of the centroid first stage, where the model has no trained CLS vector;
- the projection of the token vectors, where an index created empty asks for one and its records
  still hold the model's own vectors, once it has PROJECTION_MIN_DOCUMENTS (espn.store.projection:
  fitted once);
- the residual codec, where the records are residual codes (coded against those centroids);
- the search defaults for that many documents.

An index created empty is *exact* until it first holds `EXACT_MAX_DOCUMENTS` documents: its
base has an IVF of one list (nothing to train), no centroids, int8 in place of residual
records, and its first stage is "exact" (every live document's MaxSim, espn.search.centroid_stage).
From then on every base written is fitted, so an index that grows by writes is fitted again
each time a compaction rewrites its base (once its deltas hold half of it: it has grown by
half again, espn.live.compaction), and `espn refit` rewrites it at once. A bulk build is
fitted from the start (it has its whole corpus).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import faiss
import numpy as np

from ..ann import IVFConfig, build_ivf, default_nlist, one_list_ivf
from ..files.clock import utc_now
from ..first_stage.build import build_first_stage
from ..first_stage.centroids import FirstStageConfig
from ..mapped import map_npy
from ..params import default_search_params
from ..store.format import StoreLayout
from ..store.projection import fit_projection, projection_entry
from ..store.recode import recode_residual
from ..store.record_order import RECORD_ORDER, reorder_index_records

__all__ = ["EXACT_MAX_DOCUMENTS", "PROJECTION_MIN_DOCUMENTS", "CLS_TABLE", "Fit", "fit_base"]

#: Below this many documents an index created empty is searched exactly (chosen by measurement:
#: docs/benchmarks/live-index.md, "When an index created empty stops being exact").
EXACT_MAX_DOCUMENTS = 256
#: The fewest documents an index created empty fits its token projection on: it is fitted once, so
#: on more vectors than the first fit has (SciFact, default encoder: fitted on 2,560 documents'
#: 262k vectors it ranked at 1.001x `espn index`, on 384 documents' 31k at 0.996x;
#: docs/benchmarks/live-index.md). Until then the records keep the model's own vectors.
PROJECTION_MIN_DOCUMENTS = 2048
#: The CLS vectors of a base being written, in doc-number order (fp16; removed by `fit_base`).
CLS_TABLE = "cls.tmp.npy"


@dataclasses.dataclass(frozen=True)
class Fit:
    """How a base's trained parts are made (the manifest's `fit` section, before the figures).

    exact:   an index created empty that has not yet held EXACT_MAX_DOCUMENTS documents
    stage:   the first stage once fitted (ivf, centroids or union), with its probe and candidates
    dtype:   the records' storage type once fitted (residual codes need the centroids)
    ann:     the fitted IVF's kind (flat or pq) and code size; nlist: its lists (None: from the documents)
    projection: the dimension an index created empty projects its token vectors to once fitted
             (None: it keeps the model's; espn.store.projection)
    """

    exact: bool
    stage: FirstStageConfig
    dtype: str
    ann: str = "flat"
    pq_m: int = 32
    nlist: int | None = None
    projection: int | None = None

    def for_documents(self, n_docs: int) -> "Fit":
        """This fit for a base of `n_docs` documents: exact while an index created empty is small,
        and whenever there is nothing to fit on (no document)."""
        return dataclasses.replace(self, exact=n_docs == 0 or (self.exact and n_docs < EXACT_MAX_DOCUMENTS))

    def to_json(self) -> dict[str, Any]:
        return {"exact": self.exact, "stage": self.stage.to_json(), "dtype": self.dtype, "ann": self.ann,
                "pq_m": self.pq_m, "nlist": self.nlist, "projection": self.projection}

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> "Fit":
        """The fit a base of this manifest was written with; a base from before fits were recorded
        was fitted by its build: its stage, storage type and IVF as they are."""
        section = manifest.get("fit")
        if section is not None:
            return cls(bool(section["exact"]), FirstStageConfig.from_manifest(section["stage"]), str(section["dtype"]),
                       str(section.get("ann", "flat")), int(section.get("pq_m", 32)), section.get("nlist"),
                       section.get("projection"))
        ann = manifest.get("ann", {})
        stage = FirstStageConfig.from_manifest(manifest.get("first_stage"))
        return cls(False, stage, str(manifest["store"].get("dtype", "float16")), str(ann.get("kind", "flat")),
                   int(ann.get("pq_m") or 32), None)


def fit_base(out: Path, written: StoreLayout, n_docs: int, fit: Fit, pool_factor: int = 1) -> dict[str, Any]:
    """Fit the base at `out` (records written as `written`, CLS vectors in CLS_TABLE) and return
    the manifest's sections of what was fitted: ann, store, first_stage (None: the IVF alone),
    fit, search_defaults.

    Writes ann.faiss (the IVF with every CLS vector added), regroups the records by IVF list,
    builds the centroid first stage and recodes residual records where the fit asks for them.
    pool_factor: the index's token pooling, recorded in the store section (the records hold
    pooled vectors whatever `written` says)."""
    fit = fit.for_documents(n_docs)
    cls = map_npy(out / CLS_TABLE)
    if fit.exact:
        ivf = IVFConfig(nlist=1)
        index, trained_on = one_list_ivf(written.d_cls), 0
    else:
        ivf = IVFConfig(nlist=fit.nlist or default_nlist(n_docs), kind=fit.ann, pq_m=fit.pq_m)
        rng = np.random.default_rng(ivf.seed)
        sample = np.sort(rng.choice(n_docs, size=min(n_docs, ivf.nlist * ivf.train_points_per_list), replace=False))
        index, trained_on = build_ivf(ivf, written.d_cls, cls[sample].astype(np.float32)), len(sample)
    for start in range(0, n_docs, 65536):
        index.add(np.asarray(cls[start : start + 65536], dtype=np.float32))
    faiss.write_index(index, str(out / "ann.faiss"))
    del cls
    (out / CLS_TABLE).unlink()
    file_bytes = reorder_index_records(out, written.block_size)  # each IVF list's records together
    layout = written
    first_stage: dict[str, Any] | None = {**fit.stage.to_json(), "kind": "exact"}
    if not fit.exact:
        if fit.projection is not None and layout.d_bow > fit.projection and not projection_entry(out) \
                and n_docs >= PROJECTION_MIN_DOCUMENTS:
            layout = fit_projection(out, layout, fit.projection)  # before the centroids: they are of projected vectors
            file_bytes = (out / "embeddings.bin").stat().st_size
        first_stage = build_first_stage(out, map_npy(out / "records.npy"), layout, fit.stage.kind,
                                        previous=fit.stage.to_json())
        if layout.dtype != fit.dtype:  # residual codes, against the centroids just trained
            layout, file_bytes = recode_residual(out, layout, fit.dtype)
    return {
        "ann": {"kind": ivf.kind, "nlist": ivf.nlist, "pq_m": ivf.pq_m if ivf.kind == "pq" else None,
                "metric": "inner_product", "trained_on": trained_on},
        "store": {**layout.manifest(), "pool_factor": pool_factor, "file_bytes": file_bytes,
                  "record_order": RECORD_ORDER, **projection_entry(out)},
        "first_stage": first_stage,
        "fit": {**fit.to_json(), "documents": n_docs, "at": utc_now()},
        "search_defaults": default_search_params(ivf.nlist, max(1, n_docs)),
    }
