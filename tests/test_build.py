"""The build job through the real CLI: content, alignment, checksums, crash-resume, shards, bad input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from espn.corpus import iter_corpus
from espn.encoders import load_encoder
from espn.errors import IndexCorruptError
from espn.index import IndexDirectory
from espn.store import open_reader
from espn.store.format import StoreLayout

from helpers import run_espn, write_jsonl

CONTENT_FILES = ("embeddings.bin", "records.npy", "ids.npy", "ids_sorted.npy", "docs.jsonl", "docs_offsets.npy",
                 "ann.faiss")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_index_matches_encoder_output(scifact_index: Path, scifact_subset: Path) -> None:
    index = IndexDirectory.open(scifact_index, verify="full")
    manifest = index.manifest
    docs = list(iter_corpus(scifact_subset))
    assert manifest["counts"]["documents"] == len(docs) == 160
    assert manifest["store"]["block_size"] == 4096 and manifest["encoder"]["d_bow"] == 64
    layout = StoreLayout(manifest["store"]["d_cls"], manifest["store"]["d_bow"], manifest["store"]["block_size"])
    records = index.load_array("records.npy")

    # Placement: where records.npy says, in order, never straddling a block needlessly.
    assert np.all(np.diff(records["offset"]) > 0)
    assert np.array_equal(records["length"], (layout.d_cls + records["n_bow"].astype(np.int64) * layout.d_bow) * 2)
    start_in_block = records["offset"] % layout.block_size
    small = records["length"] <= layout.block_size
    assert np.all(start_in_block[small] + records["length"][small] <= layout.block_size)
    assert np.all(start_in_block[~small] == 0)
    assert (scifact_index / "embeddings.bin").stat().st_size % layout.block_size == 0

    # Content: each record equals the encoder's output for that document, in fp16.
    encoder = load_encoder(scifact_index / "encoder", manifest["encoder"])
    expected = encoder.encode_documents([d.full_text for d in docs[:40]])
    with open_reader("memory", scifact_index / "embeddings.bin", records, layout) as reader:
        got = reader.read(np.arange(40))
    ids = [bytes(x).decode() for x in index.load_array("ids.npy")[:40]]
    assert ids == [d.doc_id for d in docs[:40]]
    for i, (cls, bow) in enumerate(expected.split()):
        n = int(records["n_bow"][i])
        assert n == len(bow) and int(got.mask[i].sum()) == n
        # Batches were padded differently at build time; that changes float summation order only.
        np.testing.assert_allclose(got.cls[i].float().numpy(), cls.astype(np.float16).astype(np.float32), atol=2e-3)
        np.testing.assert_allclose(got.bow[i, :n].float().numpy(), bow.astype(np.float16).astype(np.float32), atol=2e-3)


def test_documents_text_and_ids_are_stored(scifact_index: Path, scifact_subset: Path) -> None:
    from espn import Searcher

    first = next(iter_corpus(scifact_subset))
    with Searcher.open(scifact_index, with_encoder=False) as searcher:
        doc = searcher.document(first.doc_id)
        assert (doc.title, doc.text) == (first.title, first.text)
        with pytest.raises(KeyError):
            searcher.document("no-such-id")


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corruption_detected_on_open(scifact_index: Path, tmp_path: Path, damage: str) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(scifact_index, copy)
    path = copy / "embeddings.bin"
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(5000)
            byte = f.read(1)
            f.seek(5000)
            f.write(bytes([byte[0] ^ 0x01]))
    else:
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 4096)
    with pytest.raises(IndexCorruptError, match="embeddings.bin"):
        IndexDirectory.open(copy)
    (tmp_path / "q.tsv").write_text("q1\tvitamin d\n")
    proc = run_espn("search", copy, "--queries", tmp_path / "q.tsv", "--out", tmp_path / "run", check=False)
    assert proc.returncode == 1
    assert "embeddings.bin" in proc.stderr and "Traceback" not in proc.stderr


def test_kill_9_then_rerun_gives_the_same_index(scifact_index: Path, scifact_subset: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    args = [sys.executable, "-m", "espn.cli", "index", str(scifact_subset), "--out", str(out), "--chunk-size", "32",
            "--nlist", "4", "--no-progress"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    chunks = out.with_name("resumed.partial") / "chunks"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(list(chunks.glob("*.npz"))) < 2:
        assert proc.poll() is None, "the build ended before it could be killed"
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(list(chunks.glob("*.npz")))
    assert 2 <= done_before < 5 and not out.exists(), "a killed build must leave no index at --out"

    rerun = run_espn("index", scifact_subset, "--out", out, "--chunk-size", "32", "--nlist", "4", "--no-progress")
    assert "resuming" in rerun.stderr
    IndexDirectory.open(out, verify="full")
    assert not out.with_name("resumed.partial").exists()
    for name in CONTENT_FILES:
        assert digest(out / name) == digest(scifact_index / name), name


def test_two_shard_processes_then_merge(scifact_index: Path, scifact_subset: Path, tmp_path: Path) -> None:
    out = tmp_path / "sharded"
    base = [sys.executable, "-m", "espn.cli", "index", str(scifact_subset), "--out", str(out), "--chunk-size", "32",
            "--nlist", "4", "--no-progress", "--loader-workers", "0"]
    procs = [subprocess.Popen(base + ["--shard", f"{i}/2"], stderr=subprocess.PIPE, text=True) for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
    assert not out.exists()
    run_espn("index-merge", "--out", out)
    IndexDirectory.open(out, verify="full")
    for name in CONTENT_FILES:
        assert digest(out / name) == digest(scifact_index / name), name


def test_existing_index_needs_force(scifact_index: Path, scifact_subset: Path) -> None:
    before = digest(scifact_index / "manifest.json")
    proc = run_espn("index", scifact_subset, "--out", scifact_index, check=False)
    assert proc.returncode == 1 and "--force" in proc.stderr
    assert digest(scifact_index / "manifest.json") == before


GOOD = {"_id": "a", "title": "Alpha", "text": "The first document is about alpha particles."}


@pytest.mark.parametrize(
    "lines, message",
    [
        ([json.dumps(GOOD), "{not json", json.dumps({**GOOD, "_id": "c"})], r"corpus.jsonl:2: malformed JSON"),
        ([json.dumps(GOOD), json.dumps({"title": "x", "text": "y"})], r"corpus.jsonl:2: missing '_id'"),
        ([json.dumps(GOOD), json.dumps({"_id": "b", "text": 5})], r"corpus.jsonl:2: 'text'"),
        ([json.dumps(GOOD), json.dumps({**GOOD, "text": "again"})], r"duplicate document id 'a'"),
        ([], r"no documents"),
    ],
    ids=["malformed-json", "missing-id", "wrong-type", "duplicate-id", "empty"],
)
def test_bad_corpus_fails_with_one_clear_line(tmp_path: Path, lines: list[str], message: str) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(line + "\n" for line in lines))
    out = tmp_path / "index"
    proc = run_espn("index", corpus, "--out", out, "--no-progress", check=False)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    import re

    assert re.search(message, errors[0]), errors[0]
    assert not out.exists()


def test_skip_bad_counts_and_skips(tmp_path: Path) -> None:
    rows = [json.dumps({**GOOD, "_id": f"d{i}", "text": f"document number {i} about topic {i % 3}"}) for i in range(40)]
    rows.insert(5, "{broken")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(rows) + "\n")
    proc = run_espn("index", corpus, "--out", tmp_path / "index", "--skip-bad", "--no-progress")
    assert "corpus.jsonl:6" in proc.stderr
    assert IndexDirectory.open(tmp_path / "index").num_documents == 40


def test_tsv_corpus_and_unreadable_file(tmp_path: Path) -> None:
    tsv = tmp_path / "collection.tsv"
    tsv.write_text("".join(f"{i}\tpassage {i} on the subject of {['rivers', 'stars', 'bread'][i % 3]}\n" for i in range(30)))
    run_espn("index", tsv, "--out", tmp_path / "index", "--no-progress")
    assert IndexDirectory.open(tmp_path / "index").num_documents == 30
    proc = run_espn("index", tmp_path / "missing.jsonl", "--out", tmp_path / "other", check=False)
    assert proc.returncode == 1 and "missing.jsonl: no such file" in proc.stderr


def test_full_disk_gives_one_line_and_no_index(tmp_path: Path) -> None:
    """A 4 MiB tmpfs fills up during the build (needs root and mount rights, as in CI's container)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN) to fill a disk")
    try:
        rows = [{"_id": f"d{i}", "title": "", "text": " ".join(["word"] * 200) + f" {i}"} for i in range(120)]
        corpus = write_jsonl(tmp_path / "corpus.jsonl", rows)
        proc = run_espn("index", corpus, "--out", mount / "index", "--bow-dim", "384", "--no-progress", check=False)
        assert proc.returncode == 1
        assert "no space left on device" in proc.stderr and "Traceback" not in proc.stderr
        assert not (mount / "index").exists()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_partitions_split_documents_evenly(tmp_path: Path) -> None:
    tsv = tmp_path / "collection.tsv"
    tsv.write_text("".join(f"p{i}\tpassage {i} about {['rivers', 'stars', 'bread', 'trains'][i % 4]}\n" for i in range(31)))
    run_espn("index", tsv, "--out", tmp_path / "parts", "--partitions", "3", "--no-progress")
    seen = []
    encoders = set()
    for p in range(3):
        part = IndexDirectory.open(tmp_path / "parts" / f"part-{p}", verify="full")
        assert part.manifest["partition"] == {"index": p, "count": 3}
        seen += [bytes(x).decode() for x in part.load_array("ids.npy")]
        encoders.add(part.manifest["files"]["encoder/projection.npy"]["sha256"])
        assert part.num_documents in (10, 11)
    assert sorted(seen) == sorted(f"p{i}" for i in range(31))
    assert len(encoders) == 1  # one shared projection: scores compare across partitions
