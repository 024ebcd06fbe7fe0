"""Snapshots and restores of a live index, taken while it is written and compacted."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from espn import Searcher
from espn.cli import main as cli_main
from espn.errors import DocumentNotFoundError, IndexCorruptError, InvalidParameterError
from espn.generation.format import read_current
from espn.generation.segments import open_view
from espn.live.checks import NewDocument
from espn.live.live_index import LiveIndex
from espn.live.snapshot import restore, snapshot
from server_fixtures import HTTP


@pytest.fixture
def index(sample_index: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "index"
    shutil.copytree(sample_index, copy)
    return copy


def test_a_snapshot_during_writes_is_one_generation_whole(index: Path, tmp_path: Path) -> None:
    """Writes (upserts and deletes) and a compaction go on while snapshots are taken: each
    snapshot verifies in full and holds exactly the writes published up to its generation."""
    writer = LiveIndex(index)
    writer.upsert([NewDocument("w-first", "the first write, before any snapshot, about glaciers")])
    published: list[tuple[int, str]] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            i = 0
            while not stop.is_set() and i < 40:
                result = writer.upsert([NewDocument(f"w-{i}", f"write number {i} about zyxolith crystals")])
                published.append((result.generation, f"w-{i}"))
                if i == 3:
                    writer.delete(["s0001"])
                if i == 5:
                    writer.compact()
                i += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=write)
    thread.start()
    snapshots = []
    try:
        for n in range(3):
            while len(published) < 2 + 3 * n and thread.is_alive():
                threading.Event().wait(0.05)
            snapshots.append((tmp_path / f"snap-{n}", snapshot(index, tmp_path / f"snap-{n}")))
    finally:
        stop.set()
        thread.join(300)
    assert not errors, errors[0]
    assert len({result.generation for _, result in snapshots}) >= 2, "the writes never moved past a snapshot"
    for path, result in snapshots:
        view = open_view(path, verify="full")  # every file and byte range against its sha256
        view.close()
        assert read_current(path).number == result.generation
        with Searcher.open(path) as searcher:
            for generation, doc_id in published:
                if generation <= result.generation:
                    assert searcher.document(doc_id).doc_id == doc_id
                else:
                    with pytest.raises(DocumentNotFoundError):
                        searcher.document(doc_id)
            lexical = {h.doc_id for h in searcher.search(["zyxolith"], k=100, mode="lexical")[0].hits}
            assert lexical == {d for g, d in published if g <= result.generation}


def test_snapshots_outlive_the_source_share_its_immutable_files_and_restore(index: Path, tmp_path: Path) -> None:
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument("kept", "a document the snapshot keeps, about coral reefs")])
    snap = tmp_path / "snap"
    assert cli_main(["snapshot", str(index), str(snap)]) == 0
    generation = read_current(snap)
    # Immutable files are hard links; embeddings.bin (appended to in place) is a copy.
    assert os.stat(snap / "ann.faiss").st_ino == os.stat(index / "ann.faiss").st_ino
    assert os.stat(snap / "embeddings.bin").st_ino != os.stat(index / "embeddings.bin").st_ino
    assert (snap / "embeddings.bin").stat().st_size == generation.embeddings_bytes
    # The source goes on: more writes, a compaction whose collector removes the old base's files.
    with LiveIndex.open(index) as writer:
        writer.delete(["kept"])
        writer.upsert([NewDocument("later", "written after the snapshot")])
        writer.compact()
    assert not (index / "ann.faiss").exists()
    open_view(snap, verify="full").close()
    # Restore, serve, and write to the restored copy: the snapshot does not change.
    restored = tmp_path / "restored"
    assert cli_main(["restore", str(snap), str(restored)]) == 0
    with Searcher.open(restored) as searcher:
        assert searcher.search(["coral reefs"], k=1, mode="hybrid")[0].hits[0].doc_id == "kept"
        with pytest.raises(DocumentNotFoundError):
            searcher.document("later")
    with LiveIndex.open(restored) as writer:
        writer.upsert([NewDocument("on-restored", "written to the restored copy")])
        writer.compact()
    open_view(snap, verify="full").close()
    assert read_current(snap).number == generation.number


def test_a_corrupted_source_or_a_used_destination_is_refused_and_leaves_nothing(index: Path, tmp_path: Path) -> None:
    with LiveIndex.open(index) as writer:
        writer.upsert([NewDocument("new", "a delta segment to corrupt")])
    segment = next(p for p in (index / "live").iterdir() if p.name.startswith("seg-"))
    data = bytearray((segment / "docs.jsonl").read_bytes())
    data[5] ^= 0xFF
    (segment / "docs.jsonl").write_bytes(bytes(data))
    with pytest.raises(IndexCorruptError, match="docs.jsonl: checksum mismatch"):
        snapshot(index, tmp_path / "snap")
    assert not (tmp_path / "snap").exists() and not (tmp_path / "snap.partial").exists()
    (tmp_path / "used").mkdir()
    with pytest.raises(InvalidParameterError, match="already exists"):
        restore(index, tmp_path / "used")


def test_a_snapshot_over_http_while_writes_run_restores_exactly_the_writes_acknowledged_before_it(
        index: Path, tmp_path: Path) -> None:
    """The real server: PUTs from several clients while POST /v1/snapshots (behind the API key)
    is taken; the snapshot restores to every write acknowledged with a generation up to its
    own, and none after."""
    import concurrent.futures

    import httpx
    from server_fixtures import running_server

    from espn.live.snapshot import CLAIM_MARKER

    key = "k" * 32
    headers = {"Authorization": f"Bearer {key}"}
    killed = tmp_path / "snaps" / "killed-before.partial"  # what a snapshot killed with an earlier server left
    killed.mkdir(parents=True)
    (killed / CLAIM_MARKER).touch()
    with running_server(index, tmp_path, "--snapshot-dir", str(tmp_path / "snaps"), "--no-warmup",
                        env={"ESPN_API_KEY": key}) as server:
        base = server.base_url
        assert not killed.exists()  # removed when the server started
        assert HTTP.post(f"{base}/v1/snapshots").status_code == 401
        acknowledged: dict[str, int] = {}
        stop = threading.Event()

        def write(worker: int) -> None:
            with httpx.Client(headers=headers, timeout=60) as client:
                i = 0
                while not stop.is_set() and i < 40:
                    doc_id = f"h{worker}-{i}"
                    answer = client.put(f"{base}/v1/documents/{doc_id}", json={"text": f"written over http {doc_id}"})
                    assert answer.status_code == 201, answer.text
                    acknowledged[doc_id] = answer.json()["generation"]
                    i += 1

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(write, w) for w in range(3)]
            while len(acknowledged) < 10:
                threading.Event().wait(0.05)
            taken = HTTP.post(f"{base}/v1/snapshots", json={"name": "mid-writes"}, headers=headers, timeout=120)
            stop.set()
            for future in futures:
                future.result()
        assert taken.status_code == 201, taken.text
        generation = taken.json()["generation"]
        again = HTTP.post(f"{base}/v1/snapshots", json={"name": "mid-writes"}, headers=headers)
        assert again.status_code == 409
        assert HTTP.post(f"{base}/v1/snapshots", json={"name": "../escape"}, headers=headers).status_code == 422
        listed = HTTP.get(f"{base}/v1/snapshots", headers=headers).json()["snapshots"]
        assert listed == [{"name": "mid-writes", "generation": generation}]
    restore(tmp_path / "snaps" / "mid-writes", tmp_path / "restored")
    with Searcher.open(tmp_path / "restored") as searcher:
        for doc_id, acked_in in acknowledged.items():
            if acked_in <= generation:
                assert searcher.document(doc_id).text == f"written over http {doc_id}"
            else:
                with pytest.raises(DocumentNotFoundError):
                    searcher.document(doc_id)
    assert any(g > generation for g in acknowledged.values())  # writes went on after the snapshot


def test_snapshots_over_http_are_off_without_a_directory(index: Path, tmp_path: Path) -> None:
    import httpx
    from server_fixtures import running_server

    with running_server(index, tmp_path, "--no-warmup") as server:
        off = HTTP.post(f"{server.base_url}/v1/snapshots")
        assert off.status_code == 404 and "--snapshot-dir" in off.json()["message"]


def test_same_name_snapshots_racing_over_http_acknowledge_one_verified_copy(index: Path, tmp_path: Path) -> None:
    """Five clients POST the same name at once, three rounds: exactly one 201 per name, the others
    409 with a message; the acknowledged copy verifies and restores, and the list names only
    complete copies (no `.partial` left behind)."""
    import concurrent.futures

    import httpx
    from server_fixtures import running_server

    snaps = tmp_path / "snaps"
    with running_server(index, tmp_path, "--snapshot-dir", str(snaps), "--no-warmup") as server:
        base = server.base_url
        for round_ in range(3):
            name = f"race-{round_}"
            barrier = threading.Barrier(5)

            def take(_: int) -> httpx.Response:
                barrier.wait()
                return HTTP.post(f"{base}/v1/snapshots", json={"name": name}, timeout=120)

            with concurrent.futures.ThreadPoolExecutor(5) as pool:
                answers = list(pool.map(take, range(5)))
            statuses = sorted(a.status_code for a in answers)
            assert statuses == [201, 409, 409, 409, 409], [a.text for a in answers]
            for answer in answers:
                if answer.status_code == 409:
                    assert answer.json()["error"] == "conflict" and name in answer.json()["message"]
            assert cli_main(["verify", str(snaps / name)]) == 0
            restore(snaps / name, tmp_path / f"restored-{round_}")
        listed = HTTP.get(f"{base}/v1/snapshots").json()["snapshots"]
        assert [s["name"] for s in listed] == ["race-0", "race-1", "race-2"]
    assert sorted(p.name for p in snaps.iterdir()) == ["race-0", "race-1", "race-2"]


def test_a_name_being_taken_is_refused_and_a_crashed_copy_does_not_block_it(index: Path, tmp_path: Path) -> None:
    """The claim is an flock: a live claim (another thread here) refuses the name at once; a
    `.partial` nobody holds (what a killed process leaves) is removed and the name taken."""
    from espn.errors import ConflictError
    from espn.live.snapshot import new_directory

    dest = tmp_path / "snap"
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with new_directory(dest, "a test claim") as staging:
            (staging / "marker").write_text("claimed")
            entered.set()
            release.wait(30)
            raise RuntimeError("abandon the claim")

    thread = threading.Thread(target=lambda: pytest.raises(RuntimeError, hold))
    thread.start()
    try:
        assert entered.wait(30)
        with pytest.raises(ConflictError, match="being taken"):
            snapshot(index, dest)
        assert (tmp_path / "snap.partial" / "marker").read_text() == "claimed"  # the holder's copy is untouched
    finally:
        release.set()
        thread.join(30)
    assert not dest.exists() and not (tmp_path / "snap.partial").exists()
    (tmp_path / "snap.partial").mkdir()  # a crashed copy's leftover: nobody holds it
    (tmp_path / "snap.partial" / "half-copied").write_bytes(b"x" * 100)
    result = snapshot(index, dest)
    assert result.files > 0 and not (tmp_path / "snap.partial").exists()
    open_view(dest, verify="full").close()
    with pytest.raises(ConflictError, match="already exists"):
        snapshot(index, dest)
