"""Every fenced shell block of README.md and docs/**/*.md either runs here, against the bundled
sample, or says on the line before it why it cannot: `<!-- not-run: REASON -->`, an HTML
comment the rendered pages (GitHub's and the MkDocs site's) do not show.

A doc command that fails when run is a doc that lies; this file is what keeps them true.

How a block runs: each page's unmarked blocks in order, in one temporary directory holding the
files the pages name (corpus.jsonl.gz, queries.jsonl, qrels/..., more.jsonl, espn/data/),
with the venv's `espn` on PATH. `espn serve ...` is started in the background and awaited on
/readyz; the doc's port (8000, 8001, ...) maps to a free one, in every command of the page.
Each other command must exit 0 (curl runs with --fail-with-body, so an HTTP error fails it),
and where the page shows what a command prints, the key parts are checked (EXPECTED).

Building the sample corpus costs a minute on 2 cores: `espn index SAMPLE --out DIR` is run once
for the whole test run (conftest's `sample_index`, the same command), and the `espn` a block
runs answers that exact command with a copy of it (`bin/espn` below). Any other command is the
real one.
"""

from __future__ import annotations

import gzip
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import markdown
import pytest
import yaml
from server_fixtures import BIN, ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DATA = ROOT / "espn" / "data"
FENCE = re.compile(r"^\s*```(?:sh|bash|shell|console)\s*$")
NOT_RUN = re.compile(r"^\s*<!-- not-run: (.+?) -->\s*$")
#: A reason names what this machine lacks or what would take too long: one of these words.
CAUSES = ("GPU", "docker", "kubectl", "Kubernetes", "SciFact", "object store", "S3", "download", "pip",
          "benchmark", "make test", "minutes", "a minute", "cores", "hostnames", "image", "servers")
#: The programs a block may run here.
RUNNABLE = ("espn", ".venv/bin/espn", "curl", "printf")  # printf: a page writes a small file for the next command
#: Placeholders of the pages and their values here (applied in this order, to every block).
SUBSTITUTIONS = (
    (r"\bNEW_INDEX\b", "new-index"),
    (r"\bINDEX\b", "index"),
    (r"(?<![\w.])/tmp/", "{work}/tmp/"),  # the tour's paths, inside this test's directory
    (r"(?<![\w.])/backups/", "{work}/backups/"),
    (r"(?<![\w/])\.venv/bin/espn\b", "espn"),  # the same program; PATH's is the one below
    (r"\bcurl -s\b", "curl -s --fail-with-body"),  # an HTTP error fails the command
)
DOC_PORT = re.compile(r"(?<=localhost:)(80\d\d)\b|(?<=127\.0\.0\.1:)(80\d\d)\b|(?<=--port )(80\d\d)\b")
#: (a pattern of the command as the page writes it, what its output must contain).
EXPECTED = (
    (r"curl .*/v1/search", ('"results"', '"id"')),
    (r'"explain": true', ('"explanation"',)),
    (r"curl -s localhost:8000/v1/documents/tour-1$", ('"Spring tides"',)),
    (r"-X PUT .*/v1/documents/", ('"created":["', '"generation"')),
    (r"espn search .*--qrels", ("nDCG@10",)),
    (r"espn stats ", ('"live_documents"', '"delta_segments"')),
)
#: `espn` for the blocks: the sample's build answered with the test run's copy, the rest exec'd.
SAMPLE_INDEX_WRAPPER = """#!/bin/sh
# `espn index <the sample corpus, .gz or not> --out DIR`: conftest's sample_index ran this command.
if [ "$#" -eq 4 ] && [ "$1" = index ] && [ "$3" = --out ] && [ ! -e "$4" ] \\
   && zcat -f -- "$2" | cmp -s - '{corpus}'; then
  cp -r '{index}' "$4" && echo "indexed 300 documents (the test run's build of the same command, copied)"
  exit
fi
exec '{espn}' "$@"
"""


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    text: str
    reason: Optional[str]  # why it is not run here; None: it runs

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def shell_blocks(page: Path, root: Path = ROOT) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, number = [], 0
    while number < len(lines):
        if FENCE.match(lines[number]):
            end = next(n for n in range(number + 1, len(lines)) if lines[n].strip().startswith("```"))
            marker = NOT_RUN.match(lines[number - 1]) if number else None
            blocks.append(Block(str(page.relative_to(root)), number + 1, "\n".join(lines[number + 1:end]),
                                marker.group(1) if marker else None))
            number = end
        number += 1
    return blocks


def commands(block: Block) -> list[tuple[int, str]]:
    """The block's commands, continuation lines joined, comment lines dropped, each with its line."""
    out: list[tuple[int, str]] = []
    pending: Optional[tuple[int, str]] = None
    for offset, raw in enumerate(block.text.splitlines(), start=block.line + 1):
        if pending is None and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        line, text = pending if pending else (offset, "")
        text += raw.strip() if pending else raw.rstrip()
        if text.endswith("\\"):
            pending = (line, text[:-1].rstrip() + " ")
            continue
        pending = None
        out.append((line, text.strip()))
    return out


def _program(command: str) -> str:
    words = shlex.split(command, comments=True)
    return words[0] if words else ""


def runs(pages: list[Path]) -> list[tuple[str, list[Block]]]:
    """Each page's unmarked blocks; a page whose blocks an earlier page has word for word (docs/index.md
    repeats the README's) is run once, under the first."""
    seen: set[tuple[str, ...]] = set()
    out = []
    for page in pages:
        blocks = [block for block in shell_blocks(page) if block.reason is None]
        texts = tuple(block.text for block in blocks)
        if blocks and texts not in seen:
            seen.add(texts)
            out.append((str(page.relative_to(ROOT)), blocks))
    return out


def unexplained(blocks: list[Block]) -> list[str]:
    """`file:line` and command of each command in an unmarked block that this file cannot run."""
    return [f"{block.where}: `{command}`" for block in blocks if block.reason is None
            for _, command in commands(block) if _program(command) not in RUNNABLE]


def test_every_shell_block_runs_here_or_says_why_not() -> None:
    blocks = [block for page in PAGES for block in shell_blocks(page)]
    assert len(blocks) >= 40 and any(block.reason for block in blocks) and any(not block.reason for block in blocks)
    vague = [f"{b.where}: {b.reason!r}" for b in blocks if b.reason and not any(c in b.reason for c in CAUSES)]
    assert not vague, f"a not-run reason names what is missing here (one of {CAUSES}): {vague}"
    neither = unexplained(blocks)
    assert not neither, ("blocks neither run here nor marked: make them run against the sample index, or put "
                         f"`<!-- not-run: REASON -->` on the line before the fence: {neither}")


def test_each_expected_output_belongs_to_a_command_that_runs() -> None:
    """An EXPECTED entry no run command matches checks nothing (its page's command was changed or marked)."""
    run = [command for _, blocks in RUNS for block in blocks for _, command in commands(block)]
    unused = [pattern for pattern, _ in EXPECTED if not any(re.search(pattern, command) for command in run)]
    assert not unused, f"EXPECTED patterns that match no command run here: {unused}"


def test_the_markers_render_away() -> None:
    """The marker is an HTML comment: with the site's Markdown extensions (mkdocs.yml) it stays a
    comment and the fence after it is still a code block."""
    extensions = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["markdown_extensions"]
    names = [item if isinstance(item, str) else next(iter(item)) for item in extensions]
    configs = {next(iter(item)): item[next(iter(item))] for item in extensions if isinstance(item, dict)}
    for page in PAGES:
        blocks = shell_blocks(page)
        if not any(block.reason for block in blocks):
            continue
        html = markdown.Markdown(extensions=names, extension_configs=configs).convert(page.read_text(encoding="utf-8"))
        shown = re.sub(r"<!--.*?-->", "", html, flags=re.S)
        assert "not-run" not in shown, f"{page.relative_to(ROOT)}: a not-run marker shows in the page"
        assert shown.count("<pre") >= len(blocks), f"{page.relative_to(ROOT)}: a marked fence is no code block"


def test_the_collector_sees_markers_and_continuations(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n<!-- not-run: needs a GPU -->\n```sh\nnvidia-smi\n```\n\n```bash\n# a comment\n"
                    "espn search INDEX \\\n    --k 3   # three\ncurl -s localhost:8000/readyz\n```\n")
    marked, unmarked = shell_blocks(page, root=tmp_path)
    assert (marked.where, marked.reason, unmarked.where, unmarked.reason) == ("page.md:3", "needs a GPU", "page.md:7", None)
    assert commands(unmarked) == [(9, "espn search INDEX --k 3   # three"), (11, "curl -s localhost:8000/readyz")]
    assert unexplained([marked, unmarked]) == []
    assert unexplained([Block("page.md", 3, marked.text, None)]) == ["page.md:3: `nvidia-smi`"]


@pytest.fixture(scope="module")
def work_files(sample_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the pages' commands read, under the names the pages give them; `bin/espn` (above)."""
    root = tmp_path_factory.mktemp("doc-files")
    corpus = (DATA / "sample_corpus.jsonl").read_bytes()
    (root / "corpus.jsonl").write_bytes(corpus)
    (root / "corpus.jsonl.gz").write_bytes(gzip.compress(corpus))
    (root / "qrels").mkdir()
    shutil.copy(DATA / "sample_queries.jsonl", root / "queries.jsonl")
    shutil.copy(DATA / "sample_qrels.tsv", root / "qrels" / "test.tsv")
    (root / "more.jsonl").write_text(
        '{"_id": "ID1", "title": "Neap tides", "text": "Neap tides come when the Sun and Moon are at right angles."}\n'
        '{"_id": "ID2", "title": "Tidal bores", "text": "A tidal bore is a wave that runs up a river."}\n')
    (root / "bin").mkdir()
    wrapper = root / "bin" / "espn"
    wrapper.write_text(SAMPLE_INDEX_WRAPPER.format(corpus=DATA / "sample_corpus.jsonl", index=sample_index,
                                           espn=BIN / "espn"))
    wrapper.chmod(0o755)
    return root


class PageRun:
    """One page's blocks, run in order in one directory; its servers, by the port the page gives them."""

    def __init__(self, work: Path, files: Path, index: Optional[Path]) -> None:
        shutil.copytree(files, work, symlinks=True, dirs_exist_ok=True)
        (work / "espn").symlink_to(ROOT / "espn")  # the pages' espn/data/... paths
        (work / "tmp").mkdir()
        (work / "backups").mkdir()
        if index is not None:  # a page that uses INDEX without building it: the sample's
            shutil.copytree(index, work / "index")
        self.work = work
        self.ports: dict[str, int] = {}
        self.servers: dict[int, ServerProcess] = {}
        self.env = {key: value for key, value in os.environ.items() if not key.startswith("ESPN_")}
        self.env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.env.update(PATH=f"{work / 'bin'}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
                        TOKENIZERS_PARALLELISM="false")

    def localise(self, command: str) -> str:
        for pattern, value in SUBSTITUTIONS:
            command = re.sub(pattern, value.replace("{work}", str(self.work)), command)
        return DOC_PORT.sub(lambda match: str(self.port(match.group(0))), command)

    def port(self, doc_port: str) -> int:
        return self.ports.setdefault(doc_port, free_port())

    def run(self, where: str, command: str) -> None:
        words = shlex.split(command, comments=True)
        if words[:2] in (["espn", "serve"], [".venv/bin/espn", "serve"]):
            return self.serve(where, command)
        started = time.monotonic()
        done = subprocess.run(["bash", "-o", "pipefail", "-c", self.localise(command)], cwd=self.work,
                              env=self.env, capture_output=True, text=True, timeout=300)
        print(f"{where}: {time.monotonic() - started:.1f} s")  # shown by pytest -s, and on a failure
        said = done.stdout + done.stderr
        logs = "".join(f"\n--- server on {port}:\n{server.log()[-3000:]}" for port, server in self.servers.items())
        assert done.returncode == 0, f"{where}: `{command}` exited {done.returncode}:\n{said[-4000:]}{logs}"
        for pattern, parts in EXPECTED:
            if re.search(pattern, command):
                missing = [part for part in parts if part not in said]
                assert not missing, f"{where}: `{command}` printed no {missing}:\n{said[-4000:]}"

    def serve(self, where: str, command: str) -> None:
        """`espn serve` in the background (as the page's second terminal or `&`), awaited on /readyz;
        a server the page started before on the same port is stopped first, as its reader would."""
        command = command.rstrip().removesuffix("&").rstrip()
        if not re.search(r"--port \d+", command):
            command += " --port 8000"
        port = self.port(re.findall(r"--port (\d+)", command)[0])
        if port in self.servers:
            self.servers.pop(port).terminate()
        shell = f"cd {shlex.quote(str(self.work))} && exec {self.localise(command)}"
        server = ServerProcess(["bash", "-c", shell], port, self.work / f"serve-{port}.log", self.env)
        self.servers[port] = server
        started = time.monotonic()
        try:
            server.wait_ready()
            print(f"{where}: ready in {time.monotonic() - started:.1f} s")
        except (AssertionError, RuntimeError) as error:
            raise AssertionError(f"{where}: `{command}` did not become ready: {error}") from None

    def close(self) -> None:
        for server in self.servers.values():
            server.terminate()


RUNS = runs(PAGES)


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [blocks for _, blocks in RUNS], ids=[page for page, _ in RUNS])
def test_the_pages_commands_run(blocks: list[Block], work_files: Path, sample_index: Path, tmp_path: Path) -> None:
    builds = any(re.search(r"--out INDEX\b", block.text) for block in blocks)
    page = PageRun(tmp_path / "work", work_files, None if builds else sample_index)
    try:
        for block in blocks:
            for line, command in commands(block):
                page.run(f"{block.page}:{line}", command)
    finally:
        page.close()
