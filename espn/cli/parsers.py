"""The parsers of the library's own subcommands (search, calibrate, verify) and the one door
to their code, `run_command`.

The commands import FAISS, the encoders and the index code at their top; they load only
when a command runs, after `espn.cli.app.run` has configured logging, so `-v` shows the
lines those libraries log as they load, and `espn --help` does not wait for them. The
choices and defaults shown here come from `espn.choices`, which imports none of them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..choices import (DEFAULT_FUSION, DEFAULT_LEXICAL_K, DEFAULT_MIX_WEIGHT, DEFAULT_RRF_K, FUSIONS, MODES, SYNTAXES,
                       TRUST_REMOTE_CODE_HELP)
from ..evaluation import DEFAULT_MEASURES
from .common import add_reader_options

__all__ = ["register_search", "register_calibrate", "register_verify", "add_search_params", "add_mode_params",
           "run_command"]


def run_command(args: argparse.Namespace) -> int:
    """Run the library's command `args.command`; its exit status."""
    from .commands import COMMANDS  # entry point: the commands load now, after logging is configured

    return COMMANDS[args.command](args)


def register_search(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", readers: list[str]) -> None:
    """The `search` subcommand; `readers` are the --reader choices."""
    p = sub.add_parser("search", help="batch queries to a TREC run file; with --qrels, print effectiveness")
    p.add_argument("index", type=Path)
    p.add_argument("--queries", type=Path, help="BEIR queries.jsonl or id<TAB>text")
    p.add_argument("--query-embeddings", type=Path, help="queries encoded elsewhere (see espn.encoders.precomputed)")
    p.add_argument("--out", type=Path, required=True, help="TREC run file to write")
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--qrels", type=Path, help="qrels (BEIR TSV or TREC) to evaluate against; only the queries it "
                   "judges are searched (BEIR's queries.jsonl holds those of every split)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--exhaustive", action="store_true", help="brute-force reference: exact CLS over all docs, "
                   "MaxSim over --rerank-count (default 1000)")
    p.add_argument("--tag", default="espn")
    p.add_argument("--strict", action="store_true", help="stop at the first query that cannot be searched (default: "
                   "report it on stderr naming its id, search the others, write their run, exit 1)")
    p.add_argument("--explain", action="store_true", help="also write OUT.explain.jsonl: per re-ranked hit, each "
                   "query token's MaxSim contribution and the passage span it matched")
    p.add_argument("--filter", metavar="JSON", help='metadata filter every hit satisfies, e.g. '
                   '\'{"topic": "oceans", "year": {"gte": 2000}}\' (see espn.filters)')
    p.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)
    add_search_params(p, readers)
    add_mode_params(p)
    p.set_defaults(handler=run_command)


def add_search_params(p: argparse.ArgumentParser, readers: list[str]) -> None:
    p.add_argument("--nprobe", type=int, help="IVF clusters visited (default: the index's)")
    p.add_argument("--prefetch-step", type=float, help="fraction of nprobe per prefetch wave, in (0, 1]")
    p.add_argument("--prefetch-k", type=int, help="candidates each prefetch wave reads (0 = off)")
    p.add_argument("--rerank-count", type=int, help="candidates re-ranked with MaxSim")
    p.add_argument("--prefetch-waves", type=int, help="most prefetch waves (1 = the paper's single prefetch)")
    p.add_argument("--no-prefetch", action="store_true", help="sequential reference path (same results)")
    p.add_argument("--reader", choices=readers, help="embedding reader (default: kvikio with CUDA, else posix)")
    add_reader_options(p)


def add_mode_params(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("search mode (lexical and hybrid need the index's full-text index)")
    g.add_argument("--mode", choices=MODES, help="dense (default), lexical (BM25) or hybrid (both, fused)")
    g.add_argument("--query-syntax", choices=SYNTAXES, help="lexical and hybrid: plain (default: every character is "
                   'text, never an operator) or simple ("phrases", +required, -excluded; what it cannot read is '
                   "read as text)")
    g.add_argument("--fusion", choices=FUSIONS, help=f"hybrid: {', '.join(FUSIONS)} (default: the index's, "
                   f"{DEFAULT_FUSION} unless `espn calibrate --hybrid` chose another)")
    g.add_argument("--lexical-k", type=int,
                   help=f"hybrid: candidates from the lexical side (default {DEFAULT_LEXICAL_K})")
    g.add_argument("--rrf-k", type=int, help=f"hybrid: the RRF constant (default {DEFAULT_RRF_K})")
    g.add_argument("--mix-weight", type=float, help="hybrid: the dense side's weight in mix and zscore (default: the "
                   f"index's, {DEFAULT_MIX_WEIGHT:.2f} unless `espn calibrate --hybrid` fitted another)")
    g.add_argument("--no-union", action="store_true",
                   help="hybrid: do not MaxSim-score what only the lexical side found")


def register_calibrate(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", readers: list[str]) -> None:
    """The `calibrate` subcommand; `readers` are the --reader choices."""
    p = sub.add_parser("calibrate", help="fit the score weight w on training queries; stored in the manifest")
    p.add_argument("index", type=Path)
    p.add_argument("--queries", type=Path, required=True)
    p.add_argument("--qrels", type=Path, required=True)
    p.add_argument("--measure", default="nDCG@10", choices=[str(m) for m in DEFAULT_MEASURES])
    p.add_argument("--dry-run", action="store_true", help="print the best w without writing it")
    p.add_argument("--hybrid", action="store_true", help="fit the hybrid mix weight (the dense side's share in "
                   "fusions 'mix' and 'zscore') instead of w, and make the best of mix, zscore and rrf the default "
                   "fusion; needs a full-text index")
    p.add_argument("--reader", choices=readers, help="embedding reader (default: kvikio with CUDA, else posix)")
    p.add_argument("--trust-remote-code", action="store_true", help=TRUST_REMOTE_CODE_HELP)
    add_reader_options(p)
    p.set_defaults(handler=run_command)


def register_verify(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """The `verify` subcommand."""
    p = sub.add_parser("verify", help="check every file of an index against its manifest checksums")
    p.add_argument("index", type=Path)
    p.set_defaults(handler=run_command)
