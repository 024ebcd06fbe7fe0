"""Helpers the tests import (`from helpers import ...`); fixtures live in conftest.py."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from PIL import Image
    from sentence_transformers import MultiVectorEncoder

    from espn.encoders.visual import VisualEncoder


#: Seconds any HTTP request of the tests may wait to connect, to send, for each read and for a
#: pooled connection: chosen for a loaded 2-core machine (a whole suite on xdist workers beside
#: other jobs), where a first search of a `--no-warmup` server, which loads its model then, took
#: longer than httpx's default 5 s. Every HTTP client of the tests uses it or longer
#: (tests/test_http_timeouts.py); waiting costs nothing when the answer comes.
HTTP_TIMEOUT_S = 60.0

#: The files a build writes byte for byte the same however it ran (resumed, sharded, merged).
CONTENT_FILES = ("embeddings.bin", "records.npy", "ids.npy", "ids_sorted.npy", "docs.jsonl", "docs_offsets.npy",
                 "ann.faiss")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_espn(*args: object, check: bool = True, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Run the real `espn` command line in a subprocess."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "espn.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, **kwargs)
    if check and proc.returncode != 0:
        raise AssertionError(f"espn {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


#: Words kept of each SciFact abstract in the tests' slices. Encoding dominates the suite's CPU
#: time and grows with document length; the tests check how builds, shards, partitions and
#: servers behave, not retrieval quality (the benchmarks run whole abstracts), so openings do.
SCIFACT_TEST_WORDS = 48


def write_scifact_subset(scifact: Path, path: Path, count: int, words: int = SCIFACT_TEST_WORDS) -> Path:
    """The first `count` SciFact documents as a corpus.jsonl, each abstract cut to its first `words` words."""
    with gzip.open(scifact / "corpus.jsonl.gz", "rt", encoding="utf-8") as src, open(path, "w", encoding="utf-8") as dst:
        for number, line in enumerate(src):
            if number >= count:
                break
            row = json.loads(line)
            row["text"] = " ".join(row["text"].split()[:words])
            dst.write(json.dumps(row) + "\n")
    return path


def write_maxsim_shards(source: Path, cls, bow, counts) -> Path:
    """Precomputed embedding shards at `source` (espn's import format, one shard) scored by MaxSim
    alone (`w = 0`, sum): what `build_from_embeddings` takes. cls [n, d], bow [T, d], counts [n]."""
    import numpy as np

    for folder in ("cls", "bow", "counts"):
        (source / folder).mkdir(parents=True)
    d = int(bow.shape[1])
    (source / "embeddings.json").write_text(json.dumps({"format": "espn-precomputed", "version": 1, "d_cls": d,
                                                        "d_bow": d, "bow_reduction": "sum", "score_weight": 0.0}))
    np.save(source / "cls" / "0.npy", cls.astype(np.float16))
    np.save(source / "bow" / "0.npy", bow.astype(np.float16))
    np.save(source / "counts" / "0.npy", counts)
    return source


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def run_threads(work: Callable[[int], None], n: int = 8) -> None:
    """Run work(0), ..., work(n - 1) on n threads released together; re-raise the first failure here."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def run(worker: int) -> None:
        try:
            barrier.wait()
            work(worker)
        except BaseException as exc:  # surfaced in the calling thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:  # not an assert: helpers.py is not rewritten by pytest, and -O would drop it
        raise AssertionError(errors)


def wait_until(check: Callable[[], object], what: str | Callable[[], str], timeout_s: float = 60.0,
               interval_s: float = 0.1, ignore: tuple[type[BaseException], ...] = ()) -> None:
    """Poll `check` until it holds; AssertionError naming `what` after `timeout_s` (a callable
    `what` is asked then: a log tail as it is at the timeout). Errors of the types in `ignore`
    (a server not answering yet) count as "not yet"; any other error of `check` ends the wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except ignore:
            pass
        time.sleep(interval_s)
    raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")


async def wait_until_async(check: Callable[[], object], what: str, timeout_s: float = 60.0,
                           interval_s: float = 0.001) -> None:
    """`wait_until` inside an event loop: polls `check` between steps of the loop's other tasks."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval_s)


def png(image: "Image.Image") -> bytes:
    """A page image as PNG bytes, as an upload or a live write sends it."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def visual_encoder(checkpoint: Path) -> "VisualEncoder":
    """espn's encoder of a visual checkpoint, as `colbert:DIR` finds it (the visual kind), on the CPU."""
    from espn.encoders import encoder_from_spec
    from espn.encoders.visual import VisualEncoder

    found = encoder_from_spec(f"colbert:{checkpoint}", device="cpu")
    assert isinstance(found, VisualEncoder) and found.kind == "visual"
    return found


def visual_library(checkpoint: Path) -> "MultiVectorEncoder":
    """Sentence Transformers' own reading of a visual checkpoint: what espn's vectors must equal."""
    from sentence_transformers import MultiVectorEncoder

    return MultiVectorEncoder(str(checkpoint), device="cpu", local_files_only=True)


def assert_tokens_map_to_their_characters(query: str, spans: list[tuple[int, int]], pieces: list[str]) -> None:
    """Each text token's span holds the characters it was made from (no surrounding space, unless the
    token is a space), in order, the first from the query's first character, and together the spans
    cover every non-space character of the query up to the last one (a query longer than the
    model's length is cut there)."""
    assert spans, query
    assert spans[0][0] == len(query) - len(query.lstrip()), (query, spans)  # the first character is text
    end = 0
    for (start, stop), piece in zip(spans, pieces):
        assert end <= start < stop <= len(query), (query, spans)
        assert query[start:stop].strip().casefold() == piece.casefold(), (query, query[start:stop], piece)
        assert query[start:stop].strip() or not piece  # only a token of whitespace has a span of whitespace
        end = stop
    import numpy as np

    covered = np.zeros(end, dtype=bool)
    for start, stop in spans:
        covered[start:stop] = True
    assert all(covered[i] or query[i].isspace() for i in range(end)), (query, spans)
