"""The code of `espn index`, `text-index`, `add` and `index-merge` (their parsers: espn_indexing.cli,
which runs these once logging is configured, so FAISS's loader lines show with -v)."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from espn.choices import DEFAULT_BOW_DTYPE
from espn.errors import UsageError
from espn.live.commands import print_write
from espn.live.live_index import LiveIndex
from espn.text.config import TextConfig
from espn.text.directory import add_text_index

from .build import BuildConfig, build_from_embeddings, build_index, keeping_partial, merge_index
from .bulk import add_corpus

__all__ = ["COMMANDS", "text_config", "cmd_index", "cmd_text_index", "cmd_index_merge", "cmd_add"]


def text_config(args: argparse.Namespace) -> Any:
    return TextConfig(language=args.text_language, stemmer=not args.text_no_stemmer,
                      stop_words=not args.text_no_stop_words, ascii_fold=args.text_ascii_fold).validate()


def cmd_text_index(args: argparse.Namespace) -> int:
    section = add_text_index(args.index, text_config(args), force=args.force)
    print(f"{args.index}: full-text index of {section['documents']} passages added ({section['build_s']:.1f}s)")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    manifest: dict[str, Any] | None
    if args.embeddings is not None:
        # Precomputed vectors are stored as given unless asked otherwise: they come from another model.
        manifest = build_from_embeddings(args.embeddings, args.out, block_size=args.block_size, nlist=args.nlist,
                                         ann=args.ann, pq_m=args.pq_m, chunk_size=args.chunk_size,
                                         corpus=args.corpus, force=args.force, score_weight=args.score_weight,
                                         pool_factor=1 if args.pool_factor is None else args.pool_factor,
                                         bow_dtype=args.bow_dtype or "float16",
                                         text_index=None if args.no_text_index else text_config(args),
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
            text_index=None if args.no_text_index else text_config(args), first_stage=args.first_stage,
            trust_remote_code=args.trust_remote_code, title_joiner=args.title_joiner,
            dpi=args.dpi, encoder_precision=args.encoder_precision,
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
    with keeping_partial(args.out):
        manifest = merge_index(args.out, partitions=args.partitions, force=args.force)
    print(f"merged {manifest['counts']['documents']} documents into {args.out}")
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    # Encoding runs without the writer lock: a server keeps taking writes meanwhile.
    with LiveIndex(args.index) as writer:
        result = add_corpus(writer, args.corpus, batch_size=args.batch_size, loader_workers=args.loader_workers,
                            progress=not args.no_progress, skip_bad=args.skip_bad, wait_s=args.wait,
                            dpi=args.dpi)
    print_write(args.index, f"{len(result.created)} added, {len(result.replaced)} replaced", result)
    return 0


#: The build job's commands by name, for espn_indexing.cli's `run_command`.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "index": cmd_index,
    "text-index": cmd_text_index,
    "index-merge": cmd_index_merge,
    "add": cmd_add,
}
