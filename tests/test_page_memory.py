"""Memory bounds of page images (espn.pages.memory): per page, per request, per process, and in the page build.

Real servers and real builds with the tiny seeded ColPali (benchmarks.make_visual_checkpoint),
each in a memory cgroup the test makes (benchmarks.common.MemoryCgroup, v1 or v2, root only;
where none can be made, the test says why and asserts the peak RSS bound alone). The pages are
1-bit PNGs of 39.7 MP, a few KB each, that decode to 119 MB of RGB: the shape of the attack the
bounds are for. The full-size cases (32 such pages in one batch and 8 concurrent PUTs in 6 GiB,
a 400-page PDF at the defaults in 1.5 GiB) take minutes on 2 cores: benchmarks/bench_page_memory.py
measures them, docs/guides/operating-limits.md gives the figures.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest
from PIL import Image

from benchmarks.bench_page_memory import one_bit_png, text_pdf
from benchmarks.common import MemoryCgroup, cgroup_unavailable_reason, rss_pss
from espn.errors import PageMemoryBusyError, TooLargeError
from espn.pages.decode import MAX_PIXELS
from espn.pages.memory import DEFAULT_PAGE_MEMORY_BYTES, PageMemory, bounded_groups, page_cost
from helpers import run_espn, wait_until
from server_fixtures import BIN, HTTP, running_server

#: The pages of the attack: 39.7 MP each (a 7300 x 5440 scan), 119 MB decoded as RGB, a few KB as 1-bit PNG.
BIG_SIDES = (7300, 5440)
#: The server's page memory in the test: one big page fits (its cost, 635 MB), two do not.
PAGE_MEMORY = 768 << 20


@contextlib.contextmanager
def memory_limit(name: str, limit: int) -> Iterator[MemoryCgroup | None]:
    """A memory cgroup of `limit` bytes for this test (removed after), or None where this machine
    cannot make one (the test then bounds peak RSS alone; the reason goes to the test's output)."""
    reason = cgroup_unavailable_reason()
    if reason is not None:
        print(f"no memory cgroup: {reason}; the peak RSS bound alone is checked")
        yield None
        return
    group = MemoryCgroup(f"espn_test_{os.getpid()}_{name}", limit)
    try:
        yield group
    finally:
        group.remove()


def in_cgroup(group: MemoryCgroup | None, argv: list[str]) -> list[str]:
    """`argv` started inside `group` (the shell moves itself in, then execs it)."""
    if group is None:
        return argv
    return ["sh", "-c", f'echo $$ > {group.path / "cgroup.procs"} && exec "$@"', "sh", *argv]


def tree_rss(pid: int) -> int:
    """The RSS of a process and its descendants now (pages they share counted in each)."""
    total = 0
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += process.memory_info().rss
    return total


@pytest.fixture(scope="module")
def page_index(colpali_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An index of 4 small pages built by `espn index` with the tiny checkpoint."""
    corpus = tmp_path_factory.mktemp("pages")
    for number in range(4):
        Image.new("RGB", (64, 48), (40 * number, 90, 200)).save(corpus / f"p{number}.png")
    out = tmp_path_factory.mktemp("idx") / "pages"
    run_espn("index", corpus, "--out", out, "--encoder", f"visual:{colpali_checkpoint}", "--bow-dtype", "float16",
             "--no-progress", "--device", "cpu")
    return out


# --- the budget itself -------------------------------------------------------------------------------------


def test_one_page_of_the_largest_size_fits_the_default_page_memory_and_a_group() -> None:
    assert page_cost(*BIG_SIDES) == 7300 * 5440 * 16
    assert page_cost(MAX_PIXELS, 1) <= DEFAULT_PAGE_MEMORY_BYTES
    assert list(bounded_groups([10, 10, 10, 10, 10], max_pages=2, max_bytes=100)) == [range(0, 2), range(2, 4),
                                                                                       range(4, 5)]
    assert list(bounded_groups([40, 40, 40, 500, 10], max_pages=8, max_bytes=100)) == [range(0, 2), range(2, 3),
                                                                                        range(3, 4), range(4, 5)]
    assert list(bounded_groups([], max_pages=8, max_bytes=100)) == []


def test_page_memory_is_held_first_come_first_served_and_refuses_what_never_fits() -> None:
    memory = PageMemory(100, wait_s=0.3)
    with pytest.raises(TooLargeError, match="over this process's page memory"):
        with memory.hold(101, "a page"):
            pass
    order: list[str] = []
    with memory.hold(80, "first"):
        # 30 more cannot be held while 80 are: it waits, then is refused for now
        started = time.monotonic()
        with pytest.raises(PageMemoryBusyError, match="not free within 0.3 s"):
            with memory.hold(30, "second"):
                pass
        assert time.monotonic() - started >= 0.3
        memory.wait_s = 30.0
        waiter = threading.Thread(target=_hold, args=(memory, 30, order, "waiter"))
        waiter.start()
        wait_until(lambda: memory.held == 80 and not order, "the waiter to wait", timeout_s=5)
        order.append("first done")
    waiter.join(10)
    assert order == ["first done", "waiter"] and memory.held == 0


def _hold(memory: PageMemory, nbytes: int, order: list[str], name: str) -> None:
    with memory.hold(nbytes, name):
        order.append(name)


# --- a server -----------------------------------------------------------------------------------------------


def _upsert(doc_id: str, image: bytes) -> dict:
    return {"id": doc_id, "image": base64.b64encode(image).decode()}


@pytest.mark.slow
def test_a_batch_of_big_pages_and_concurrent_puts_stay_within_the_servers_page_memory(
        page_index: Path, tmp_path: Path) -> None:
    """4 pages of 39.7 MP in one batch, then 3 at once as single PUTs: every write is done, and the
    server's peak RSS grows by at most its page memory (768 MiB) over what it held when ready, in a
    6 GiB cgroup. Before the bound every page of a request was decoded before any was encoded: the
    server grew 1,325 MiB here."""
    root = tmp_path / "index"
    shutil.copytree(page_index, root)
    big = one_bit_png(BIG_SIDES)
    with memory_limit("server", 6 << 30) as cgroup:
        espn = in_cgroup(cgroup, [str(BIN / "espn")]) if cgroup is not None else ()
        with running_server(root, tmp_path, "--page-memory-bytes", str(PAGE_MEMORY), espn=espn) as server:
            ready = rss_pss(server.pid)["rss"]
            batch = {"upsert": [_upsert(f"big-{i}", big) for i in range(4)]}
            assert len(json.dumps(batch)) < 1 << 20  # within the body limit: a few KB a page
            answer = HTTP.post(f"{server.base_url}/v1/documents/batch", json=batch, timeout=600)
            assert answer.status_code == 200, answer.text
            assert sorted(answer.json()["created"]) == [f"big-{i}" for i in range(4)]
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                puts = list(pool.map(lambda i: HTTP.put(f"{server.base_url}/v1/documents/put-{i}",
                                                        json={"image": _upsert("", big)["image"]}, timeout=600),
                                     range(3)))
            assert [p.status_code for p in puts] == [201] * 3, [p.text for p in puts]
            peak = rss_pss(server.pid)["peak_rss"]
            hits = HTTP.post(f"{server.base_url}/v1/search", json={"query": "page", "k": 20}, timeout=60).json()
            assert {h["id"] for h in hits["results"]} >= {"big-0", "put-2"}
        if cgroup is not None:
            assert cgroup.oom_kills() == 0
    grown = peak - ready
    assert grown <= PAGE_MEMORY, f"the server grew {grown / 2**20:.0f} MiB over {ready / 2**20:.0f} MiB " \
                                 f"(page memory {PAGE_MEMORY >> 20} MiB)"


def test_a_page_that_can_never_fit_is_413_and_the_next_page_is_written(page_index: Path, tmp_path: Path) -> None:
    root = tmp_path / "index"
    shutil.copytree(page_index, root)
    with running_server(root, tmp_path, "--page-memory-bytes", str(256 << 20), "--no-warmup") as server:
        big = base64.b64encode(one_bit_png(BIG_SIDES)).decode()
        small = io.BytesIO()
        Image.new("RGB", (64, 48), (1, 2, 3)).save(small, format="PNG")
        refused = HTTP.put(f"{server.base_url}/v1/documents/big", json={"image": big}, timeout=300)
        assert refused.status_code == 413, refused.text
        assert refused.json()["error"] == "too_large"
        assert "document 'big': image would take 606 MiB decoded, over this process's page memory of 256 MiB" \
            in refused.json()["message"]
        batch = HTTP.post(f"{server.base_url}/v1/documents/batch", timeout=300, json={"upsert": [
            {"id": "ok", "image": base64.b64encode(small.getvalue()).decode()}, {"id": "big", "image": big}]})
        assert batch.status_code == 413 and batch.json()["error"] == "too_large"  # all or nothing
        assert HTTP.get(f"{server.base_url}/v1/documents/ok", timeout=60).status_code == 404
        written = HTTP.put(f"{server.base_url}/v1/documents/ok", timeout=300,
                           json={"image": base64.b64encode(small.getvalue()).decode()})
        assert written.status_code == 201, written.text
        assert "Traceback" not in server.log()


# --- the page build -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_page_build_streams_pages_in_bounded_memory_whatever_the_chunk_size(
        colpali_checkpoint: Path, tmp_path: Path) -> None:
    """`espn index` of a 300-page PDF of text at the default dpi, chunk size and loader, in a 1.5 GiB
    cgroup: it completes, and the build's processes together never held more than 1.5 GiB. Before,
    a chunk of rendered pages (6 MB each) was held whole: the cgroup killed the page loader."""
    pdf = text_pdf(tmp_path / "report.pdf", 300)
    assert pdf.stat().st_size < 100_000
    limit = 3 << 29  # 1.5 GiB
    out = tmp_path / "index"
    with memory_limit("build", limit) as cgroup:
        command = [sys.executable, "-m", "espn.cli", "index", str(pdf), "--out", str(out), "--encoder",
                   f"visual:{colpali_checkpoint}", "--no-progress", "--device", "cpu"]
        build = subprocess.Popen(in_cgroup(cgroup, command), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True)
        peak = 0
        while build.poll() is None:  # the process tree's RSS, sampled (shared pages counted in each)
            peak = max(peak, tree_rss(build.pid))
            time.sleep(0.05)
        _, stderr = build.communicate()
        assert build.returncode == 0, stderr[-3000:]
        if cgroup is not None:
            assert cgroup.oom_kills() == 0
    assert json.loads((out / "manifest.json").read_text())["counts"]["documents"] == 300
    assert peak <= limit, f"the build's processes held {peak / 2**20:.0f} MiB at once"
