"""espn.engine, the library's one door for the programs that serve it: it loads light and lends
what it lists; a registry opened in process (no HTTP) serves, writes, closes idle indexes and
deletes them through the lifecycle's states, answering every waiting request; and per-query
isolation answers the good queries of a batch that holds a refused one."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import espn.engine as engine_door
from espn.engine import IndexConfig, Lifecycle, NewDocument, SearchOptions, ServeConfig, open_engines
from espn.engine.admin import MAX_CONCURRENT_CREATIONS
from espn.engine.lifecycle import IllegalTransition, IndexLife
from espn.errors import (ConflictError, IndexNotFoundError, InvalidParameterError, OverBudgetError,
                         ReadOnlyIndexError, UnavailableError)
from espn.params import MAX_QUERY_CHARS
from espn.search.isolation import encode_together, search_isolated, sort_outcomes
from espn.search.searcher import Searcher

#: The most names the door may lend (tests/test_code_layout.py holds the server to it).
MAX_DOOR_NAMES = 25


def test_the_door_loads_no_torch_or_faiss_and_lends_every_name_it_lists() -> None:
    # `espn --help` reads the server's settings, which import the door: it must stay light.
    code = ("import sys, espn.engine as e\n"
            "print(sorted(m for m in ('torch', 'faiss') if m in sys.modules))\n"
            "print(sorted(n for n in e.__all__ if not hasattr(e, n)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    heavy, missing = done.stdout.splitlines()
    assert heavy == "[]", heavy
    assert missing == "[]", f"espn.engine lists names it does not lend: {missing}"
    assert len(engine_door.__all__) == len(set(engine_door.__all__)) <= MAX_DOOR_NAMES
    assert not hasattr(engine_door, "__getattr__"), "the door is a module of names, not a lazy bag"


def test_the_lifecycle_moves_only_along_its_edges_and_wakes_its_waiters() -> None:
    async def scenario() -> list[str]:
        life = IndexLife()
        seen: list[str] = []

        async def wait_ready() -> None:
            await life.wait_until(lambda l: l.state is Lifecycle.READY)
            seen.append("ready")

        waiter = asyncio.create_task(wait_ready())
        await asyncio.sleep(0)
        life.move(Lifecycle.OPENING)
        await asyncio.sleep(0)
        assert seen == []  # opening is not ready: still waiting
        life.move(Lifecycle.READY)
        await asyncio.wait_for(waiter, 5)
        with pytest.raises(IllegalTransition):
            life.move(Lifecycle.OPENING)  # an open index is not opened again
        life.enter()
        assert not await life.wait_until(lambda l: l.inside == 0, timeout_s=0.05)
        life.leave()
        assert await life.wait_until(lambda l: l.inside == 0, timeout_s=5)
        return seen

    assert asyncio.run(scenario()) == ["ready"]


def _config(default: Path, others: dict[str, Path], root: Path | None = None, **index: object) -> ServeConfig:
    return ServeConfig(indexes={"default": default, **others}, default="default", root=root,
                       index=IndexConfig(reader="memory", warmup=False, **index))  # type: ignore[arg-type]


def test_a_registry_in_process_searches_writes_and_closes_an_idle_index(sample_index: Path, tmp_path: Path) -> None:
    for name in ("main", "other"):
        shutil.copytree(sample_index, tmp_path / name)

    async def scenario() -> None:
        engines = open_engines(_config(tmp_path / "main", {"other": tmp_path / "other"}, max_request_work=100))
        await engines.start()
        try:
            async with engines.use() as engine:
                answer = await engine.search(["ocean tides"], SearchOptions(k=3, return_text=True))
                (hits,) = [a.result.hits for a in answer.answers]
                assert len(hits) == 3 and answer.documents is not None and hits[0].doc_id in answer.documents
                written = await engine.write([NewDocument("moon-doc", "The Moon pulls the oceans into tides.")], [])
                assert written.created == ["moon-doc"]
                found = await engine.search(["moon pulls oceans tides"], SearchOptions(k=5))
                assert "moon-doc" in [h.doc_id for h in found.answers[0].result.hits]
                with pytest.raises(OverBudgetError):
                    await engine.search(["a"] * 2, SearchOptions(k=60, rerank_count=60))  # 2 x 60 > 100
            assert engines.info("other").state is Lifecycle.CLOSED  # opens at its first request
            async with engines.use("other") as other:
                ids = [h.doc_id for a in (await other.search(["ocean tides"], SearchOptions(k=5))).answers
                       for h in a.result.hits]
                assert "moon-doc" not in ids  # a write to one index never reaches another
                assert engines.info("other").state is Lifecycle.READY
            await engines.close_idle(0.0)  # type: ignore[attr-defined]
            assert engines.info("other").state is Lifecycle.CLOSED
            assert engines.info("default").state is Lifecycle.READY  # the default never closes when idle
            with pytest.raises(IndexNotFoundError):
                async with engines.use("nope"):
                    pass
        finally:
            await engines.close()
        assert engines.info("default").state is Lifecycle.CLOSED

    asyncio.run(scenario())


def test_requests_arriving_while_an_index_closes_wait_and_reopen_it(sample_index: Path, tmp_path: Path) -> None:
    shutil.copytree(sample_index, tmp_path / "main")
    shutil.copytree(sample_index, tmp_path / "lazy")

    async def scenario() -> list[int]:
        engines = open_engines(_config(tmp_path / "main", {"lazy": tmp_path / "lazy"}))
        await engines.start()
        try:
            async with engines.use("lazy"):
                pass
            closing = asyncio.create_task(engines.close_idle(0.0))  # type: ignore[attr-defined]
            await asyncio.sleep(0)  # the close has begun: the state is closing

            async def one() -> int:
                async with engines.use("lazy") as engine:
                    return len((await engine.search(["vaccines"], SearchOptions(k=2))).answers[0].result.hits)

            counts = await asyncio.gather(*(one() for _ in range(4)))
            await closing
            return list(counts)
        finally:
            await engines.close()

    assert asyncio.run(scenario()) == [2, 2, 2, 2]


def test_a_deletion_waits_for_the_requests_inside_and_refuses_new_ones(sample_index: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(sample_index, tmp_path / "main")
    shutil.copytree(sample_index, root / "doomed")

    async def scenario() -> None:
        engines = open_engines(_config(tmp_path / "main", {}, root=root))
        await engines.start()
        try:
            with pytest.raises(ConflictError, match="default index"):
                await engines.delete("default")
            inside = asyncio.Event()
            release = asyncio.Event()

            async def long_request() -> int:
                async with engines.use("doomed") as engine:
                    inside.set()
                    await release.wait()
                    return len((await engine.search(["vaccines"], SearchOptions(k=2))).answers[0].result.hits)

            request = asyncio.create_task(long_request())
            await inside.wait()
            deletion = asyncio.create_task(engines.delete("doomed"))
            await asyncio.sleep(0.05)
            assert not deletion.done()  # it waits for the request inside
            with pytest.raises(IndexNotFoundError):  # a new request is refused at once
                async with engines.use("doomed"):
                    pass
            release.set()
            assert await request == 2  # the request inside was answered
            await deletion
            assert not (root / "doomed").exists()
            assert "doomed" not in [info.name for info in engines.describe()]
        finally:
            await engines.close()

    asyncio.run(scenario())


def test_a_write_to_an_index_deleted_under_it_is_a_clean_not_found(sample_index: Path, tmp_path: Path) -> None:
    """Another process deletes the index (renames it away) while a request is inside: the write is
    refused as a missing index (404), never an internal error."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(sample_index, tmp_path / "main")
    shutil.copytree(sample_index, root / "gone")

    async def scenario() -> None:
        engines = open_engines(_config(tmp_path / "main", {}, root=root))
        await engines.start()
        try:
            async with engines.use("gone") as engine:
                await engine.write([NewDocument("first", "Written before the deletion.")], [])
                (root / "gone").rename(root / ".deleted-gone-by-another-worker")
                with pytest.raises(IndexNotFoundError, match="deleted"):
                    await engine.write([NewDocument("second", "Written after it.")], [])
        finally:
            await engines.close()

    asyncio.run(scenario())


def test_creations_beyond_the_limit_are_refused_at_once_and_the_others_all_finish(sample_index: Path,
                                                                                 tmp_path: Path) -> None:
    """Six creations at once: the first loads the model while the next three wait for it; the fifth
    and sixth are refused (503, retry) before anything is made; the four are searchable, and a
    refused name can be created once the others are done."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copytree(sample_index, tmp_path / "main")
    config = dataclasses.replace(_config(tmp_path / "main", {}, root=root), models={"small": "minilm"})

    async def scenario() -> None:
        engines = open_engines(config)
        await engines.start()
        try:
            names = [f"made-{i}" for i in range(MAX_CONCURRENT_CREATIONS + 2)]
            outcomes = await asyncio.gather(*(engines.create(n, "small") for n in names), return_exceptions=True)
            refused = [n for n, o in zip(names, outcomes) if isinstance(o, UnavailableError)]
            assert refused == names[MAX_CONCURRENT_CREATIONS:], outcomes
            assert all(not (root / n).exists() for n in refused)
            for name in names[:MAX_CONCURRENT_CREATIONS]:
                async with engines.use(name) as engine:
                    answer = await engine.search(["ocean tides"], SearchOptions(k=3))
                    assert answer.answers[0].result.hits == []  # created empty
            assert (await engines.create(refused[0], "small")).documents == 0
        finally:
            await engines.close()

    asyncio.run(scenario())


def test_a_read_only_index_refuses_writes_in_the_librarys_words(sample_index: Path) -> None:
    async def scenario() -> None:
        engines = open_engines(_config(sample_index, {}, read_only=True))
        await engines.start()
        try:
            async with engines.use() as engine:
                with pytest.raises(ReadOnlyIndexError, match="read-only"):
                    await engine.write([NewDocument("x", "text")], [])
                assert engine.readiness().read_only is True
        finally:
            await engines.close()

    asyncio.run(scenario())


def test_sort_outcomes_tells_a_refusal_from_a_failure() -> None:
    refused, failed = InvalidParameterError("no text"), ValueError("a bug")
    outcomes = sort_outcomes(["a", refused, failed, "d"])
    assert outcomes.answered == {0: "a", 3: "d"}
    assert outcomes.refused == {1: refused}
    assert outcomes.failed == {2: failed}


def test_search_isolated_answers_the_others_and_keeps_the_shared_encode_in_the_stage_times(
        sample_index: Path) -> None:
    searcher = Searcher.open(sample_index, reader="memory")
    try:
        too_long = "x " * MAX_QUERY_CHARS
        results = search_isolated(searcher, ["vaccines", too_long, "ocean temperature"], {"k": 3})
        assert isinstance(results[1], InvalidParameterError) and "characters" in str(results[1])
        assert [len(r.hits) for r in results if not isinstance(r, InvalidParameterError)] == [3, 3]

        groups = [(["vaccines", "protein folding"], {"k": 2}), (["ocean temperature"], {"k": 4})]
        shared, encode_ms = encode_together(searcher, groups)
        assert [None if e is None else len(e) for e in shared] == [2, 1] and encode_ms > 0
        together = search_isolated(searcher, groups[0][0], groups[0][1], embeddings=shared[0], encode_ms=encode_ms)
        alone = searcher.search(groups[0][0], k=2)
        assert [[h.doc_id for h in r.hits] for r in together] == [[h.doc_id for h in r.hits] for r in alone]
        stage_ms = together[0].stats.stage_ms
        assert stage_ms["encode"] == round(encode_ms, 3) and stage_ms["total"] >= stage_ms["encode"]
    finally:
        searcher.close()
