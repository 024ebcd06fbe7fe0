"""Nothing a write leaves behind outlives it: a `kill -9` at each crash point of the live writer,
then a restart without warm-up, then a clean stop.

Real `espn serve` processes (tests/crash_serve.py is the real server with the writer's crash hook
set) on a copy of the sample index, one after another: each server acknowledges one write,
then is killed at its crash point in the middle of a second one (a replacement of the first,
so that it writes tombstones), and the next server, started with `--no-warmup`, must find the
index clean as soon as it is ready (no staging directory such as live/stage-text-*, no file
of an unpublished generation, no record past the published end of embeddings.bin) and serve
every acknowledged write. The last one stops cleanly and leaves the index clean too.
"""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import httpx
import pytest

from espn.generation.format import read_current
from espn.live.staging import NUMBERED
from server_fixtures import HTTP, ServerProcess, running_server

CRASH_SERVE = [sys.executable, str(Path(__file__).with_name("crash_serve.py"))]
#: The writer's crash points in the order a write reaches them (espn.live.commit, espn.generation.segment_files,
#: espn.live.text_side, espn.live.writer), and the how-manyth time a server reaches each when it is killed:
#: the second write reaches every point but "tombstones" a second time (the first adds an id, it replaces none).
CRASH_POINTS = {"queued": 2, "encoded": 2, "appended": 2, "segment": 2, "tombstones": 1, "text-published": 2,
                "generation": 2, "published": 2}
#: No background compaction among the crashes: only the write path is under test here.
ENV = {"ESPN_COMPACT_MAX_SEGMENTS": "1000"}


def leftovers(index: Path) -> list[str]:
    """What in the index belongs to no published generation: staging directories, temporary
    files, files numbered past the current generation, records past its end of embeddings.bin."""
    if not (index / "live").is_dir():
        return []  # never written to
    current = read_current(index)
    found = []
    for path in sorted((index / "live").iterdir()):
        numbered = NUMBERED.match(path.name)
        if path.name.startswith("stage-") or path.name.endswith(".tmp") or path.name == "incoming" \
                or (numbered is not None and int(numbered[2]) > current.number):
            found.append(f"live/{path.name}")
    embeddings = index / current.base / "embeddings.bin"
    if embeddings.stat().st_size != current.embeddings_bytes:
        found.append(f"{embeddings.name}: {embeddings.stat().st_size} bytes, {current.embeddings_bytes} published")
    return found


def _put(server: ServerProcess, doc_id: str, text: str) -> httpx.Response:
    return HTTP.put(f"{server.base_url}/v1/documents/{doc_id}", json={"text": text}, timeout=120)


def _text(server: ServerProcess, doc_id: str) -> str | None:
    answer = HTTP.get(f"{server.base_url}/v1/documents/{doc_id}", timeout=60)
    assert answer.status_code in (200, 404), answer.text
    return answer.json()["text"] if answer.status_code == 200 else None


@pytest.mark.slow
def test_a_kill_9_at_every_crash_point_of_a_write_leaves_nothing_after_a_restart_without_warm_up(
        sample_index: Path, tmp_path: Path) -> None:
    index = tmp_path / "index"
    shutil.copytree(sample_index, index)
    expected: dict[str, str] = {}  # id -> the text acknowledged (or published when the answer was lost)
    for point, reached in [*CRASH_POINTS.items(), (None, 0)]:
        env = dict(ENV, ESPN_TEST_CRASH_AT=f"{point}:{reached}") if point else ENV
        with running_server(index, tmp_path, "--no-warmup", env=env, name=f"after-{point}",
                            espn=CRASH_SERVE if point else ()) as server:
            assert leftovers(index) == [], f"left after the kill at the previous point: {leftovers(index)}"
            for doc_id, text in expected.items():
                assert _text(server, doc_id) == text, doc_id
            if point is None:
                break
            doc_id = f"doc-{point}"
            assert _put(server, doc_id, f"first text of {point}: a lighthouse keeper").status_code == 201
            expected[doc_id] = f"first text of {point}: a lighthouse keeper"
            with pytest.raises(httpx.TransportError):
                _put(server, doc_id, f"second text of {point}: a volcano erupting")
            assert server.process.wait(60) == -signal.SIGKILL, point
            if point == "published":  # durable before the kill; only its answer was lost
                expected[doc_id] = f"second text of {point}: a volcano erupting"
            # the full-text side's work directory (made by the first write) outlived its process
            assert [p.name for p in (index / "live").iterdir() if p.name.startswith("stage-text-")], point
    assert leftovers(index) == []  # after the clean stop of the last server
    assert read_current(index).number == len(CRASH_POINTS) + 1  # each point's first write, and the published one
