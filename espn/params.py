"""Per-request search parameters: defaults from the manifest, bounds checked in one place."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

from .choices import DEFAULT_FUSION, DEFAULT_LEXICAL_K, DEFAULT_MIX_WEIGHT, DEFAULT_RRF_K, FUSIONS, MODES, SYNTAXES
from .errors import InvalidParameterError

__all__ = ["SearchParams", "DEFAULT_RERANK_COUNT", "MAX_K", "MAX_QUERY_CHARS", "MAX_RERANK", "MAX_PREFETCH_K", "FIRST_STAGE_KINDS",
           "MAX_PROBE", "MAX_CANDIDATES", "NO_TEXT_PATTERN", "has_text", "default_search_params",
           "HybridParams", "MAX_LEXICAL_K", "check_syntax"]

MAX_K = 10_000
#: Characters of one query text (the library refuses longer; the HTTP schema states the same bound).
MAX_QUERY_CHARS = 10_000
MAX_RERANK = 10_000
MAX_PREFETCH_K = 10_000
#: The candidate generators (espn.first_stage.centroids), here so that checking a request's parameters does
#: not load FAISS. ivf: the CLS (pooled) vector in the IVF (today's pipeline); centroids: the
#: token-level centroid index; union: both, their candidates re-ranked together; exact: every
#: live document is a candidate (what an index too small for a fitted first stage searches with).
FIRST_STAGE_KINDS = ("ivf", "centroids", "union", "exact")
MAX_PROBE = 1024  # centroids a query token visits
MAX_CANDIDATES = 10_000  # documents the centroid stage hands to MaxSim

# A query with nothing to search: only whitespace, control characters and invisible format
# characters (zero-width spaces, joiners, marks, BOM). One definition for the library, the
# server's batch checks and the HTTP schema, written as a pattern both Python and JSON Schema
# read (no \s or \p{..}, which differ between the two).
_NOT_TEXT = r"\x00-\x20\x7f-\xa0\xad\u1680\u180e\u2000-\u200f\u2028-\u202f\u205f-\u2064\u3000\ufeff"
NO_TEXT_PATTERN = f"^[{_NOT_TEXT}]*$"
_NO_TEXT = re.compile(NO_TEXT_PATTERN)


def has_text(query: str) -> bool:
    """True when `query` holds a character to search (see NO_TEXT_PATTERN)."""
    return _NO_TEXT.fullmatch(query) is None


#: Candidates re-ranked with MaxSim unless told otherwise, chosen on SciFact's train queries
#: (`python -m benchmarks.bench_rerank --split train`, docs/benchmarks/batches-and-reranking.md):
#: 64 keeps 99.9% of the nDCG@10 of re-ranking 1000 and reads 36% less than 100 did.
DEFAULT_RERANK_COUNT = 64


@dataclasses.dataclass(frozen=True)
class SearchParams:
    """What one search call may tune.

    k:             results returned per query
    nprobe:        η, IVF clusters visited (1 .. nlist)
    prefetch_step: fraction of η after which each prefetch wave starts (0 < s <= 1);
                   waves start after δ = ceil(s·η) clusters, then every δ clusters
    prefetch_k:    candidates each prefetch wave reads (0 turns prefetching off;
                   None follows rerank_count, so a deeper re-rank prefetches deeper)
    rerank_count:  candidates re-ranked with MaxSim; below it the CLS order is kept
    prefetch_waves: most prefetch waves per search (None: one after every segment
                   but the last; 1: the paper's single prefetch after δ clusters)
    prefetch:      False runs the sequential reference path (same results, no thread)
    first_stage:   candidate generator: "ivf" (the CLS vector's IVF), "centroids" (the
                   token-level centroid index), "union" (both) or "exact" (every live document,
                   scored with MaxSim); None: the manifest's
    first_stage_probe: centroids each query token visits (None: the manifest's)
    first_stage_candidates: documents the centroid stage hands to MaxSim (None: the manifest's)
    """

    k: int = 10
    nprobe: int = 16
    prefetch_step: float = 0.3
    prefetch_k: int | None = None
    rerank_count: int = DEFAULT_RERANK_COUNT
    prefetch_waves: int | None = None
    prefetch: bool = True
    first_stage: str | None = None
    first_stage_probe: int | None = None
    first_stage_candidates: int | None = None

    def replace(self, **overrides: Any) -> "SearchParams":
        """A copy with the given non-None overrides, validated."""
        given = {key: value for key, value in overrides.items() if value is not None}
        unknown = set(given) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise InvalidParameterError(f"unknown search parameter(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **given)

    def validate(self, nlist: int, num_documents: int) -> "SearchParams":
        """Raise InvalidParameterError naming the first parameter out of range."""
        _check_int("k", self.k, 1, MAX_K)
        _check_int("nprobe", self.nprobe, 1, nlist)
        if not isinstance(self.prefetch_step, (int, float)) or isinstance(self.prefetch_step, bool) or not (
            0.0 < float(self.prefetch_step) <= 1.0 and math.isfinite(self.prefetch_step)
        ):
            raise InvalidParameterError(f"prefetch_step must be in (0, 1], got {self.prefetch_step!r}")
        if self.prefetch_k is not None:
            _check_int("prefetch_k", self.prefetch_k, 0, MAX_PREFETCH_K)
        _check_int("rerank_count", self.rerank_count, 0, MAX_RERANK)
        if self.prefetch_waves is not None:
            _check_int("prefetch_waves", self.prefetch_waves, 1, 1000)
        if not isinstance(self.prefetch, bool):
            raise InvalidParameterError(f"prefetch must be true or false, got {self.prefetch!r}")
        if self.first_stage is not None and self.first_stage not in FIRST_STAGE_KINDS:
            raise InvalidParameterError(f"first_stage must be one of {', '.join(FIRST_STAGE_KINDS)}, "
                                        f"got {self.first_stage!r}")
        if self.first_stage_probe is not None:
            _check_int("first_stage_probe", self.first_stage_probe, 1, MAX_PROBE)
        if self.first_stage_candidates is not None:
            _check_int("first_stage_candidates", self.first_stage_candidates, 1, MAX_CANDIDATES)
        del num_documents  # k above the corpus size is allowed: fewer hits come back
        return self

    @property
    def wave_size(self) -> int:
        """Candidates per prefetch wave."""
        return self.rerank_count if self.prefetch_k is None else self.prefetch_k

    @property
    def candidates(self) -> int:
        """How many ANN candidates the pipeline keeps: enough for k and for re-ranking."""
        return max(self.k, self.rerank_count)

    @classmethod
    def from_manifest(cls, defaults: Mapping[str, Any]) -> "SearchParams":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in defaults.items() if key in known})


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidParameterError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def default_search_params(nlist: int, num_documents: int) -> dict[str, Any]:
    """Defaults stored in the manifest (tuned on SciFact train queries; see docs/benchmarks/effectiveness.md).

    nprobe scans about max(4000 documents, 5% of the corpus): on SciFact (5,183 documents) that is
    99 of 128 lists, within 0.1% nDCG@10 of an exhaustive search; on MS MARCO (8192 lists)
    about 410 lists.
    """
    per_list = max(1.0, num_documents / nlist)
    budget = max(4000.0, 0.05 * num_documents)
    return {
        "k": 10,
        "nprobe": int(min(nlist, max(1, math.ceil(budget / per_list)))),
        "prefetch_step": 0.3,
        "prefetch_k": None,  # follow rerank_count
        "rerank_count": DEFAULT_RERANK_COUNT,
    }


def check_syntax(syntax: str) -> str:
    """`syntax` if it is one of the query syntaxes the lexical side reads (espn.text.query)."""
    if syntax not in SYNTAXES:
        raise InvalidParameterError(f"syntax must be one of {', '.join(SYNTAXES)}, got {syntax!r}")
    return syntax


MAX_LEXICAL_K = 10_000


@dataclasses.dataclass(frozen=True)
class HybridParams:
    """What a search may set about modes and fusion (defaults: the manifest's `hybrid` section).

    mode:       dense (vectors only), lexical (BM25 only) or hybrid (both, fused)
    fusion:     rrf, mix or zscore (see the module doc)
    lexical_k:  candidates taken from the lexical side
    rrf_k:      the constant of reciprocal rank fusion
    mix_weight: α, the dense side's weight in mix and zscore, in [0, 1]
    union:      read and MaxSim-score the documents only the lexical side found
    syntax:     how the lexical side reads a query: plain text (default) or the opt-in
                simple syntax ("phrases", +required, -excluded; `espn.text.query`)
    """

    mode: str = MODES[0]
    fusion: str = DEFAULT_FUSION  # espn.choices says why zscore at 0.80
    lexical_k: int = DEFAULT_LEXICAL_K
    rrf_k: int = DEFAULT_RRF_K
    mix_weight: float = DEFAULT_MIX_WEIGHT
    union: bool = True
    syntax: str = SYNTAXES[0]

    def replace(self, **overrides: Any) -> "HybridParams":
        given = {key: value for key, value in overrides.items() if value is not None}
        return dataclasses.replace(self, **given).validate()

    def validate(self) -> "HybridParams":
        if self.mode not in MODES:
            raise InvalidParameterError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.fusion not in FUSIONS:
            raise InvalidParameterError(f"fusion must be one of {', '.join(FUSIONS)}, got {self.fusion!r}")
        for name, low, high in (("lexical_k", 1, MAX_LEXICAL_K), ("rrf_k", 1, 100_000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidParameterError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        weight = self.mix_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
                math.isfinite(weight) and 0.0 <= weight <= 1.0):
            raise InvalidParameterError(f"mix_weight must be a number in [0, 1], got {weight!r}")
        if not isinstance(self.union, bool):
            raise InvalidParameterError(f"union must be true or false, got {self.union!r}")
        check_syntax(self.syntax)
        return self

    def to_json(self) -> dict[str, Any]:
        return {"fusion": self.fusion, "lexical_k": self.lexical_k, "rrf_k": self.rrf_k,
                "mix_weight": self.mix_weight, "union": self.union}

    @classmethod
    def from_manifest(cls, section: Mapping[str, Any] | None) -> "HybridParams":
        known = {f.name for f in dataclasses.fields(cls)} - {"mode", "syntax"}
        return cls(**{key: value for key, value in (section or {}).items() if key in known}).validate()
