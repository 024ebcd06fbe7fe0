"""`espn index`, `text-index`, `add` and `index-merge`: registered into the `espn` command by entry point."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from espn.encoders import ENCODER_SPECS
from espn.errors import UsageError
from espn.live.commands import add_wait_option, print_write
from espn.params import FIRST_STAGE_KINDS
from espn.text.config import STEMMER_LANGUAGES, TextConfig

__all__ = ["register"]


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
    that act on a live index are the library's: espn.live.commands)."""
    _add_index(sub)
    p = sub.add_parser("text-index", help="add a full-text index (for lexical and hybrid search) to an existing index")
    p.add_argument("index", type=Path)
    p.add_argument("--force", action="store_true", help="rebuild it when the index has one")
    _text_options(p)
    p.set_defaults(handler=cmd_text_index)
    _add_add(sub)
    p = sub.add_parser("index-merge", help="assemble the shards of `espn index --shard I/N` into the index")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--partitions", type=int, default=1)
    p.add_argument("--force", action="store_true")
    p.set_defaults(handler=cmd_index_merge)


def _add_index(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("index", help="build an index from a corpus (BEIR corpus.jsonl[.gz] or id<TAB>text TSV)")
    p.add_argument("corpus", type=Path, nargs="?", help="corpus file (omit with --embeddings)")
    p.add_argument("--out", type=Path, required=True, help="index directory to create")
    p.add_argument("--encoder", default="minilm", help="one of: " + "; ".join(ENCODER_SPECS))
    p.add_argument("--embeddings", type=Path, help="build from precomputed embedding shards in this directory")
    p.add_argument("--bow-dim", type=int, default=64, help="BOW dimensions after PCA (384 = no projection)")
    p.add_argument("--nlist", type=int, help="IVF lists (default: from the corpus size)")
    p.add_argument("--ann", choices=("flat", "pq"), default="flat", help="IVF-Flat (default) or IVF-PQ")
    p.add_argument("--pq-m", type=int, default=32, help="PQ bytes per vector with --ann pq")
    p.add_argument("--block-size", type=int, default=4096, help="record block size in bytes")
    p.add_argument("--pool-factor", type=int, default=None,
                   help="pool each document's BOW vectors by about this factor at index time (1 = none; "
                        "default 2, 1 for colberter and --embeddings)")
    p.add_argument("--bow-dtype", choices=("float16", "int8"), default=None,
                   help="how vectors are stored in embeddings.bin (default int8; float16 for --embeddings)")
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
    p.add_argument("--skip-bad", action="store_true", help="skip malformed corpus lines instead of failing")
    p.add_argument("--force", action="store_true", help="replace an existing index at --out")
    p.add_argument("--device", help="torch device for encoding (default: cuda if available)")
    p.add_argument("--loader-workers", type=int, default=1, help="tokenising processes (0 = in-process)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-text-index", action="store_true",
                   help="no full-text index (lexical and hybrid search need one; `espn text-index` adds it later)")
    _text_options(p)
    p.set_defaults(handler=cmd_index)


def _add_add(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("add", help="add or replace documents of a live index (upsert by id) from a corpus file")
    p.add_argument("index", type=Path)
    p.add_argument("corpus", type=Path, help="BEIR corpus.jsonl[.gz] or id<TAB>text TSV; an id that exists is replaced")
    p.add_argument("--batch-size", type=int, default=32, help="documents per model batch")
    p.add_argument("--loader-workers", type=int, default=1, help="tokenising processes (0 = in-process)")
    p.add_argument("--first-stage", choices=FIRST_STAGE_KINDS, default=None,
                   help="candidate generator: ivf (the CLS vector), centroids (token-level centroid index) or "
                        "union (default: centroids for models without a trained CLS vector, else ivf)")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed corpus lines instead of failing")
    add_wait_option(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=cmd_add)


def _text_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-language", default="english", choices=STEMMER_LANGUAGES,
                   help="the full-text index's stemmer and stop-word language (default english)")
    p.add_argument("--text-no-stemmer", action="store_true", help="index words unstemmed")
    p.add_argument("--text-no-stop-words", action="store_true", help="keep stop words")
    p.add_argument("--text-ascii-fold", action="store_true", help="fold accented letters to ASCII")


def _text_config(args: argparse.Namespace) -> Any:
    return TextConfig(language=args.text_language, stemmer=not args.text_no_stemmer,
                      stop_words=not args.text_no_stop_words, ascii_fold=args.text_ascii_fold).validate()


def cmd_text_index(args: argparse.Namespace) -> int:
    from espn.text.directory import add_text_index

    section = add_text_index(args.index, _text_config(args), force=args.force)
    print(f"{args.index}: full-text index of {section['documents']} passages added ({section['build_s']:.1f}s)")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from .build import DEFAULT_BOW_DTYPE, BuildConfig, build_from_embeddings, build_index, keeping_partial

    manifest: dict[str, Any] | None
    if args.embeddings is not None:
        # Precomputed vectors are stored as given unless asked otherwise: they come from another model.
        manifest = build_from_embeddings(args.embeddings, args.out, block_size=args.block_size, nlist=args.nlist,
                                         ann=args.ann, pq_m=args.pq_m, chunk_size=args.chunk_size,
                                         corpus=args.corpus, force=args.force, score_weight=args.score_weight,
                                         pool_factor=1 if args.pool_factor is None else args.pool_factor,
                                         bow_dtype=args.bow_dtype or "float16",
                                         text_index=None if args.no_text_index else _text_config(args),
                                         first_stage=args.first_stage)
    else:
        if args.corpus is None:
            raise UsageError("give a CORPUS file or --embeddings DIR")
        config = BuildConfig(
            corpus=args.corpus, out=args.out, encoder=args.encoder, bow_dim=args.bow_dim, nlist=args.nlist,
            ann=args.ann, pq_m=args.pq_m, block_size=args.block_size, chunk_size=args.chunk_size,
            pool_factor=args.pool_factor, bow_dtype=args.bow_dtype or DEFAULT_BOW_DTYPE, bow_pooling=args.bow_pooling,
            batch_size=args.batch_size, skip_bad=args.skip_bad, force=args.force, shard=args.shard[0],
            num_shards=args.shard[1], partitions=args.partitions, device=args.device,
            loader_workers=args.loader_workers, progress=not args.no_progress, score_weight=args.score_weight,
            text_index=None if args.no_text_index else _text_config(args), first_stage=args.first_stage,
        )
        with keeping_partial(args.out):
            manifest = build_index(config)
    if manifest is None:
        print(f"shard encoded; when all shards are done run: espn index-merge --out {args.out}")
    else:
        counts = manifest["counts"]
        print(f"indexed {counts['documents']} documents ({counts['bow_vectors']} BOW vectors) into {args.out}")
    return 0


def cmd_index_merge(args: argparse.Namespace) -> int:
    from .build import keeping_partial, merge_index

    with keeping_partial(args.out):
        manifest = merge_index(args.out, partitions=args.partitions, force=args.force)
    print(f"merged {manifest['counts']['documents']} documents into {args.out}")
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    from espn.live.live_index import LiveIndex  # FAISS loads after logging is configured (-v)

    from .bulk import add_corpus

    # Encoding runs without the writer lock: a server keeps taking writes meanwhile.
    with LiveIndex(args.index) as writer:
        result = add_corpus(writer, args.corpus, batch_size=args.batch_size, loader_workers=args.loader_workers,
                            progress=not args.no_progress, skip_bad=args.skip_bad, wait_s=args.wait)
    print_write(args.index, f"{len(result.created)} added, {len(result.replaced)} replaced", result)
    return 0
