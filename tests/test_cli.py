"""The command line as a user meets it: every error one line on stderr, exit 1 (2 for usage).

The cases run `espn.cli.main` in this process (fd-level capture, so anything a library
prints is counted too); two run the real `espn` in a subprocess, where FAISS's loader used
to add four INFO lines to every error. The set of subcommands covered must equal what
`espn --help` lists, so a new subcommand without error cases fails here.
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from espn.choices import READER_NAMES
from espn.cli import OWN_LOGGERS, build_parser, main
from espn.search.validation import MAX_QUERY_CHARS
from espn.store import READERS

ROOT = Path(__file__).resolve().parents[1]
NOWHERE = "/nonexistent/espn-index"
#: What `espn --help` must not wait for: each takes from 0.1 to 2 s to import.
HEAVY = ("torch", "faiss", "tantivy", "transformers", "uvicorn")


@pytest.fixture()
def isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """main() sets environment variables (serve exports its settings) and logging: undo both after."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("ESPN_")})
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in OWN_LOGGERS}
    yield
    root.handlers[:], root.level = handlers, level
    for name, value in levels.items():
        logging.getLogger(name).setLevel(value)


def _cases(sample_index: Path, tmp_path: Path) -> list[tuple[list[str], int, str]]:
    queries = ROOT / "espn" / "data" / "sample_queries.jsonl"
    run = str(tmp_path / "run.trec")
    return [
        (["nope"], 2, "espn: error: argument command: invalid choice"),
        (["search", str(sample_index), "--queries", str(queries)], 2, "the following arguments are required: --out"),
        (["search", str(sample_index), "--out", run], 2, "give exactly one of --queries and --query-embeddings"),
        (["search", str(sample_index), "--queries", str(queries), "--out", run, "--k", "0"], 1, "k must be an integer"),
        (["search", str(sample_index), "--queries", str(queries), "--out", run, "--filter", "{"], 1,
         "filter: not valid JSON"),
        (["search", NOWHERE, "--queries", str(queries), "--out", run], 1, "is not an ESPN index directory"),
        (["search", str(sample_index), "--queries", str(queries), "--out", "/nonexistent/dir/run"], 1,
         "does not exist"),
        (["calibrate", str(sample_index), "--queries", str(queries)], 2, "required: --qrels"),
        (["calibrate", str(sample_index), "--queries", str(tmp_path / "none.jsonl"), "--qrels",
          str(tmp_path / "none.tsv")], 1, "no such file"),
        (["verify", NOWHERE], 1, "no such index directory"),
        (["index", "--out", str(tmp_path / "new")], 2, "give a CORPUS file or --embeddings DIR"),
        (["index", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "new")], 1, "no such file"),
        (["index", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "new"), "--shard", "3/2"], 2, "0 <= I < N"),
        (["add", NOWHERE, str(queries)], 1, "not an espn index"),
        (["add", str(sample_index)], 2, "required: corpus"),
        (["delete", NOWHERE], 2, "give ids to delete, or --ids-file FILE"),
        (["delete", NOWHERE, "some-id"], 1, "not an espn index"),
        (["compact", NOWHERE], 1, "not an espn index"),
        (["create", str(tmp_path / "made"), "--encoder", "nope:zz"], 1, "--encoder must be 'minilm'"),
        (["create", str(sample_index)], 1, "exists"),
        (["refit", NOWHERE], 1, "not an espn index"),
        (["key-hash"], 2, "no key on stdin"),
        (["stats", NOWHERE], 1, "not an espn index"),
        (["snapshot", NOWHERE, str(tmp_path / "snap")], 1, "not an espn index"),
        (["snapshot", str(sample_index), str(tmp_path)], 1, "already exists; a snapshot goes to a new directory"),
        (["restore", str(sample_index)], 2, "required: dest"),
        (["restore", NOWHERE, str(tmp_path / "restored")], 1, "not an espn index"),
        (["restore", "s3://", str(tmp_path / "restored")], 1, "expected s3://BUCKET[/PREFIX]"),
        (["publish", NOWHERE, "s3://bucket/prefix"], 1, "not an espn index"),
        (["publish", str(sample_index), "gs://bucket"], 1, "expected s3://BUCKET[/PREFIX]"),
        (["text-index", NOWHERE], 1, "not an espn index"),
        (["text-index", str(sample_index)], 1, "already has a full-text index (pass --force to rebuild it)"),
        (["text-index", str(sample_index), "--text-language", "klingon"], 2, "invalid choice: 'klingon'"),
        (["index-merge"], 2, "required: --out"),
        (["index-merge", "--out", str(tmp_path / "never-built")], 1, "no build in progress"),
        (["serve", NOWHERE], 2, "index (ESPN_INDEX) /nonexistent/espn-index is not an ESPN index directory"),
        (["serve", str(sample_index), "--port", "70000"], 2, "port (ESPN_PORT)"),
        (["serve", str(sample_index), "--workers", "two"], 2, "workers (ESPN_WORKERS)"),
        (["serve", str(sample_index), "--follow", "ftp://bucket"], 2, "follow (ESPN_FOLLOW)"),
        (["route"], 2, "give the partitions' URLs (--shards) or a shard map (--shard-map s3://...)"),
        (["route", "--shard-map", "gs://bucket"], 2, "shard_map (ESPN_ROUTER_SHARD_MAP)"),
        (["shard-map", "init", "s3://bucket/prefix"], 2, "shard-map init needs --partitions S"),
        (["shard-map", "init", "s3://", "--partitions", "2"], 1, "expected s3://BUCKET[/PREFIX]"),
        (["shard-map", "init", "s3://bucket/prefix", "--partitions", "3"], 1, "partitions must divide 1024"),
        (["reshard", "s3://bucket/prefix"], 2, "the following arguments are required: --partitions, --work"),
        (["reshard", "gs://bucket", "--partitions", "3", "--work", str(tmp_path / "work")], 1,
         "expected s3://BUCKET[/PREFIX]"),
        (["route", "--shards", "ftp://a"], 2, "shard URL must be http(s)"),
        (["route", "--shards", "http://a:1", "--timeout-ms", "0"], 2, "timeout_ms (ESPN_ROUTER_TIMEOUT_MS)"),
    ]


def test_every_error_is_one_line(isolated: None, sample_index: Path, tmp_path: Path,
                                 capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # `espn key-hash` reads its key there: none given
    cases = _cases(sample_index, tmp_path)
    listed = set(next(a for a in build_parser()._actions if a.dest == "command").choices)
    assert {argv[0] for argv, _, _ in cases} - {"nope"} == listed, "every subcommand needs error cases here"
    for argv, status, message in cases:
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code
        out, err = capfd.readouterr()
        lines = err.splitlines()
        command = "espn" if argv[0] == "nope" else f"espn {argv[0]}"
        assert code == status, (argv, code, err)
        assert len(lines) == 1 and lines[0].startswith(f"{command}: error: "), (argv, err)
        assert message in lines[0], (argv, lines[0])
        assert out == "", (argv, out)


def test_a_writer_publishing_to_object_storage_runs_one_worker(isolated: None, sample_index: Path,
                                                               capfd: pytest.CaptureFixture) -> None:
    code = main(["serve", str(sample_index), "--publish", "s3://bucket/prefix", "--workers", "2"])
    lines = capfd.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and "--publish runs one worker (--workers 1)" in lines[0], lines


def _espn(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ESPN_", "TRANSFORMERS_VERBOSITY"))}
    return subprocess.run([sys.executable, "-m", "espn.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**clean, **(env or {})}, cwd=ROOT)


def test_a_real_process_says_one_line_and_verbose_brings_the_libraries_back(tmp_path: Path) -> None:
    done = _espn("verify", NOWHERE)  # imports FAISS, whose loader logs its fallbacks at INFO
    assert done.returncode == 1 and done.stderr.splitlines() == [f"espn verify: error: {NOWHERE}: no such index "
                                                                 "directory"], done.stderr
    loud = _espn("-v", "verify", NOWHERE)
    assert loud.returncode == 1 and "faiss.loader" in loud.stderr and "Traceback" in loud.stderr
    assert loud.stderr.splitlines()[-1] == done.stderr.strip()


def test_serve_refuses_an_empty_api_key_in_one_line(sample_index: Path) -> None:
    done = _espn("serve", str(sample_index), "--port", "0", env={"ESPN_API_KEY": ""})
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == ["espn serve: error: api_key (ESPN_API_KEY) is empty; unset ESPN_API_KEY to "
                                        "serve without a key, or give one of at least 16 characters (e.g. `openssl "
                                        "rand -hex 32`)"]


def test_search_with_qrels_searches_the_queries_it_judges(sample_index: Path, tmp_path: Path) -> None:
    """What the docs' SciFact commands rely on: queries.jsonl holds every split, --qrels picks one."""
    queries = tmp_path / "queries.jsonl"
    rows = (ROOT / "espn" / "data" / "sample_queries.jsonl").read_text().splitlines()
    queries.write_text("\n".join(rows + ['{"_id": "unjudged-1", "text": "a query the qrels do not judge"}']) + "\n")
    run = tmp_path / "run.trec"
    done = _espn("search", str(sample_index), "--queries", str(queries), "--qrels",
                 str(ROOT / "espn" / "data" / "sample_qrels.tsv"), "--out", str(run), "--k", "5")
    assert done.returncode == 0, done.stderr
    judged = {line.split("\t")[0] for line in (ROOT / "espn" / "data" / "sample_qrels.tsv").read_text().splitlines()[1:]}
    searched = {line.split()[0] for line in run.read_text().splitlines()}
    assert searched == judged and f"searching the {len(judged)} of {len(rows) + 1} queries" in done.stdout
    assert "nDCG@10" in done.stdout


@pytest.mark.parametrize("argv", [["--help"], ["search", "--help"], ["index", "--help"], ["serve", "--help"]],
                         ids=" ".join)
def test_help_imports_no_heavy_library(argv: list[str]) -> None:
    """The parsers' choices and defaults come from light modules (espn.choices, the settings); the
    commands' code, which imports torch, FAISS, tantivy and uvicorn, loads only when one runs."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "espn.cli", *argv], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and "usage: espn" in done.stdout, done.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "espn.cli.app" in imported  # the lines are there to read
    heavy = sorted(name for name in imported if name.split(".")[0] in HEAVY)
    assert not heavy, f"`espn {' '.join(argv)}` imports {heavy[:10]}"


def test_the_reader_choices_are_the_readers() -> None:
    assert READER_NAMES == tuple(sorted(READERS))


def test_serve_on_a_port_in_use_says_so_before_loading_the_index(sample_index: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _espn("serve", str(sample_index), "--host", "127.0.0.1", "--port", str(port))
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [f"espn serve: error: port {port} on 127.0.0.1 is in use (another server?); "
                                        "stop it or give another --port (ESPN_PORT)"]


def test_a_batch_whose_only_query_is_refused_says_so(isolated: None, sample_index: Path, tmp_path: Path,
                                                     capfd: pytest.CaptureFixture) -> None:
    """A 1 MB query: refused naming its id and the limit; no queries/s figure for a batch that searched nothing."""
    queries = tmp_path / "huge.jsonl"
    queries.write_text(json.dumps({"_id": "huge", "text": "word " * 200_000}) + "\n")
    code = main(["search", str(sample_index), "--queries", str(queries), "--out", str(tmp_path / "run.trec")])
    out, err = capfd.readouterr()
    assert code == 1, err
    assert "queries/s" not in out and "wrote 0 lines for 0 queries" in out, out
    assert [line for line in err.splitlines() if "espn search: error:" in line] == [
        f"espn search: error: query huge: the query has 999999 characters; at most {MAX_QUERY_CHARS}",
        "espn search: error: no query was searched: the only query was refused (huge; why above)"], err
