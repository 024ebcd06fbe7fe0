"""`espn index`, `text-index`, `add` and `index-merge`: their parsers, registered into the `espn` command by entry
point; their code is espn_indexing.commands."""

from __future__ import annotations

import argparse
from pathlib import Path

from espn.choices import (ENCODER_SPECS, INT8_MIN_OVERLAP, PAGE_DPI, PRECISIONS, STEMMER_LANGUAGES, STORAGE_TYPES,
                          TRUST_REMOTE_CODE_HELP)
from espn.corpus import COLBERT_TITLE_JOINER, PASSAGE_JOINER
from espn.live.parsers import add_wait_option
from espn.params import FIRST_STAGE_KINDS

__all__ = ["register", "run_command"]


def run_command(args: argparse.Namespace) -> int:
    """Run the build job's command `args.command`; its exit status."""
    from .commands import COMMANDS  # entry point: the commands load FAISS and torch now, after logging is configured

    return COMMANDS[args.command](args)


def _shard(value: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/2, got {value!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"shard I/N needs 0 <= I < N, got {value!r}")
    return i, n


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Add `index`, `text-index`, `add` and `index-merge` to the `espn` subcommands (the commands
    that act on a live index are the library's: espn.live.parsers)."""
    _add_index(sub)
    p = sub.add_parser("text-index", help="add a full-text index (for lexical and hybrid search) to an existing index")
    p.add_argument("index", type=Path)
    p.add_argument("--force", action="store_true", help="rebuild it when the index has one")
    _text_options(p)
    p.set_defaults(handler=run_command)
    _add_add(sub)
    p = sub.add_parser("index-merge", help="assemble the shards of `espn index --shard I/N` into the index")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--partitions", type=int, default=1)
    p.add_argument("--force", action="store_true")
    p.set_defaults(handler=run_command)


def _add_index(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("index", help="build an index from a corpus (BEIR corpus.jsonl[.gz] or id<TAB>text TSV) or "
                                     "from pages (a folder of images or PDFs, a PDF, a JSONL of images)")
    p.add_argument("corpus", type=Path, nargs="?",
                   help="corpus file, or pages for a ColPali-class --encoder (omit with --embeddings)")
    p.add_argument("--out", type=Path, required=True, help="index directory to create")
    p.add_argument("--encoder", default="minilm", help="one of: " + "; ".join(ENCODER_SPECS))
    p.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)
    p.add_argument("--encoder-precision", choices=PRECISIONS, default="fp32",
                   help="minilm/hf/colbert on a CPU: int8 runs queries and documents through the ONNX graph "
                        "quantised to int8, refused when its top 10 keeps less than "
                        f"{INT8_MIN_OVERLAP} of fp32's on the bundled probe; int8-unchecked accepts it "
                        "whatever it measures (default fp32)")
    p.add_argument("--embeddings", type=Path, help="build from precomputed embedding shards in this directory")
    p.add_argument("--bow-dim", type=int, default=64, help="BOW dimensions after PCA (384 = no projection)")
    p.add_argument("--nlist", type=int, help="IVF lists (default: from the corpus size)")
    p.add_argument("--ann", choices=("flat", "pq"), default="flat", help="IVF-Flat (default) or IVF-PQ")
    p.add_argument("--pq-m", type=int, default=32, help="PQ bytes per vector with --ann pq")
    p.add_argument("--block-size", type=int, default=4096, help="record block size in bytes")
    p.add_argument("--pool-factor", type=int, default=None,
                   help="pool each document's BOW vectors by about this factor at index time (1 = none; "
                        "default 2, 1 for colberter and --embeddings)")
    p.add_argument("--bow-dtype", choices=STORAGE_TYPES, default=None,
                   help="how vectors are stored in embeddings.bin (default int8; float16 for --embeddings); "
                        "residual2/residual4: a centroid id and 2 or 4 bits per dimension (needs the centroid "
                        "first stage)")
    p.add_argument("--bow-pooling", choices=("tokens", "words"), default="tokens",
                   help="minilm/hf: one BOW vector per token (default) or per whole word, stop words dropped")
    p.add_argument("--chunk-size", type=int, default=1024, help="documents per chunk (the unit of resume)")
    p.add_argument("--batch-size", type=int, default=32, help="documents per model batch")
    p.add_argument("--shard", type=_shard, default=(0, 1), metavar="I/N", help="encode only shard I of N")
    p.add_argument("--partitions", type=int, default=1, help="write S index partitions OUT/part-0.. sharing one encoder")
    p.add_argument("--score-weight", type=float, help="w in w·cls + (1-w)·bow (default: the model's, else 0.3; "
                   "`espn calibrate` fits it)")
    p.add_argument("--first-stage", choices=FIRST_STAGE_KINDS, default=None,
                   help="candidate generator: ivf (the CLS vector), centroids (token-level centroid index) or "
                        "union (default: centroids for models without a trained CLS vector, else ivf)")
    p.add_argument("--title-joiner", default=None, metavar="TEXT",
                   help="what joins a BEIR title to its text in the passage the model reads (recorded in the "
                        f"manifest; default {COLBERT_TITLE_JOINER!r} for colbert: models, as PyLate and Sentence "
                        f"Transformers evaluate BEIR, {PASSAGE_JOINER!r} for the others)")
    _dpi_option(p)
    p.add_argument("--skip-bad", action="store_true", help="skip malformed corpus lines instead of failing")
    p.add_argument("--force", action="store_true", help="replace an existing index at --out")
    p.add_argument("--device", help="torch device for encoding (default: cuda if available)")
    p.add_argument("--loader-workers", type=int, default=1, help="tokenising processes (0 = in-process)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-text-index", action="store_true",
                   help="no full-text index (lexical and hybrid search need one; `espn text-index` adds it later)")
    _text_options(p)
    p.set_defaults(handler=run_command)


def _add_add(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("add", help="add or replace documents of a live index (upsert by id) from a corpus file")
    p.add_argument("index", type=Path)
    p.add_argument("corpus", type=Path, help="BEIR corpus.jsonl[.gz] or id<TAB>text TSV; for an index of pages, a folder "
                   "of images or PDFs, a PDF, or a JSONL of images; an id that exists is replaced")
    p.add_argument("--batch-size", type=int, default=32, help="documents per model batch")
    _dpi_option(p)
    p.add_argument("--loader-workers", type=int, default=1, help="tokenising processes (0 = in-process)")
    p.add_argument("--first-stage", choices=FIRST_STAGE_KINDS, default=None,
                   help="candidate generator: ivf (the CLS vector), centroids (token-level centroid index) or "
                        "union (default: centroids for models without a trained CLS vector, else ivf)")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed corpus lines instead of failing")
    add_wait_option(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_command)


def _dpi_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dpi", type=int, default=PAGE_DPI[2],
                   help=f"pages: the resolution PDF pages are rendered at, {PAGE_DPI[0]} to {PAGE_DPI[1]} "
                        f"(default {PAGE_DPI[2]})")


def _text_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-language", default="english", choices=STEMMER_LANGUAGES,
                   help="the full-text index's stemmer and stop-word language (default english)")
    p.add_argument("--text-no-stemmer", action="store_true", help="index words unstemmed")
    p.add_argument("--text-no-stop-words", action="store_true", help="keep stop words")
    p.add_argument("--text-ascii-fold", action="store_true", help="fold accented letters to ASCII")
