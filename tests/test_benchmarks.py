"""Every benchmark script runs in its quick mode on a tiny synthetic index, so none can rot.

The numbers are not checked (a loaded CI machine makes them meaningless); the scripts
must finish, print their markdown table and write their JSON (and PNG). Parts that need
root (cgroups, dropping the page cache), fio, or the SciFact data skip with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import common
from espn.first_stage.build import PAGE_FIRST_STAGE

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def sample_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample index, built for these tests alone: they check that the benchmarks leave it
    untouched (no live/), while under xdist a server of another file may hold the shared one's
    writer lock (live/LOCK) at the same time."""
    from conftest import SAMPLE_CORPUS, built_once
    from helpers import run_espn

    return built_once(tmp_path_factory, "sample-benchmarks", lambda out: run_espn("index", SAMPLE_CORPUS, "--out", out,
                                                                                    "--no-progress"))


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory: pytest.TempPathFactory, sample_index: Path) -> Path:
    """2,000 synthetic documents around the real vectors of an index built in this session.

    The full SciFact index gives the docs' geometry (docs/benchmarks/index.md); the bundled sample corpus keeps
    the test self-contained on a fresh machine.
    """
    from benchmarks.make_synthetic import generate

    out = tmp_path_factory.mktemp("synth") / "tiny"
    info = generate(out, 2000, sample_index, queries=64, chunk_size=512, nlist=16, ann="flat")
    assert info["documents"] == 2000 and (out / "manifest.json").is_file()
    assert 20 <= info["mean_bow"] <= 40  # MS MARCO-like bags
    return out


@pytest.fixture()
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    return tmp_path


def _check(results: Path, name: str, capsys: pytest.CaptureFixture, png: bool = True) -> dict:
    out = capsys.readouterr().out
    assert "|---" in out, out
    payload = json.loads((results / f"{name}.json").read_text())
    if png:
        assert (results / f"{name}.png").stat().st_size > 0
    return payload


def test_synthetic_index_searches(tiny_index: Path) -> None:
    from espn import Searcher

    queries = common.load_queries(tiny_index.with_name(tiny_index.name + ".queries.npz"))
    with Searcher.open(tiny_index, reader="posix", verify="none") as s:
        batch = common.take_queries(queries, [0, 1, 2])
        fast = s.search_embeddings(batch, k=5, prefetch=True)
        slow = s.search_embeddings(batch, k=5, prefetch=False)
    assert [[h.doc_id for h in r.hits] for r in fast] == [[h.doc_id for h in r.hits] for r in slow]


def test_bench_prefetch(tiny_index: Path, results: Path, capsys) -> None:
    from benchmarks import bench_prefetch

    assert bench_prefetch.main(["--index", str(tiny_index), "--scifact", "", "--quick", "--steps", "0.1,0.3"]) == 0
    payload = _check(results, "prefetch", capsys)
    rows = next(iter(payload["studies"].values()))
    assert len(rows) == 4 and all(0.0 <= r["hit_rate"] <= 1.0 for r in rows)


def test_bench_batch(tiny_index: Path, results: Path, capsys) -> None:
    from benchmarks import bench_batch

    assert bench_batch.main(["--index", str(tiny_index), "--quick", "--reranks", "16,64", "--queries", "8"]) == 0
    payload = _check(results, "batch", capsys)
    assert {r["batch"] for r in payload["runs"]} == {1, 4, 16}


def test_bench_io(tiny_index: Path, results: Path, capsys) -> None:
    from benchmarks import bench_io

    argv = ["--index", str(tiny_index), "--quick", "--seconds", "0.3"]
    if shutil.which("fio") is None:
        argv.append("--no-fio")  # the script itself degrades too; this keeps the test fast
    assert bench_io.main(argv) == 0
    payload = _check(results, "io", capsys)
    assert payload["rounds"][0]["posix16_blocks"]["iops"] > 0


def test_bench_faults(tiny_index: Path, results: Path, capsys) -> None:
    from benchmarks import bench_faults

    queries = tiny_index.with_name(tiny_index.name + ".queries.npz")
    argv = ["--index", str(tiny_index), "--queries-npz", str(queries), "--quick", "--rate", "0.2"]
    assert bench_faults.main(argv) == 0
    payload = _check(results, "faults", capsys, png=False)
    assert all(r["rankings_differing"] == 0 and r["errors"] == 0 for r in payload["runs"]), payload["runs"]


def test_bench_memory(tiny_index: Path, results: Path, capsys) -> None:
    from benchmarks import bench_memory

    reason = common.cgroup_unavailable_reason()
    if reason:
        pytest.skip(f"memory cgroups unavailable here: {reason}")
    argv = ["--index", str(tiny_index), "--quick", "--fractions", "0.5", "--n", "5", "--warmup", "2"]
    assert bench_memory.main(argv) == 0
    payload = _check(results, "memory_limits", capsys)
    ok = [r for r in payload["runs"] if "error" not in r]
    assert {(r["reader"], r["prefetch"]) for r in ok} == {("mmap", 0), ("posix", 0), ("posix", 1)}
    assert all(r["limit"] for r in ok)


def test_bench_record_cache_replays_each_policy(tiny_index: Path, results: Path, capsys) -> None:
    from benchmarks import bench_record_cache
    from espn.store.cache_policy import POLICIES

    assert bench_record_cache.main(["--index", str(tiny_index), "--quick", "--topics", "8"]) == 0
    payload = _check(results, "record_cache_policy", capsys, png=False)
    assert {key.split("/")[2] for key in payload["cells"]} == set(POLICIES)
    assert all(0 <= cell["hit_rate"] <= 1 for cell in payload["cells"].values())


def test_bench_cache_curves(tiny_index: Path, results: Path, capsys) -> None:
    from benchmarks import bench_cache_curves

    argv = ["--index", str(tiny_index), "--quick", "--topics", "8"]
    if common.cgroup_unavailable_reason():
        argv.append("--no-limit")
    assert bench_cache_curves.main(argv) == 0
    payload = _check(results, "cache_curves", capsys)
    ok = [r for r in payload["runs"] if "error" not in r]
    assert ok == payload["runs"], [r["error"] for r in payload["runs"] if "error" in r]
    assert {r["config"] for r in ok} == {"posix", "posix+cache", "mmap", "memory"}
    assert all(r["record_cache"]["hits"] > 0 for r in ok if r["config"] == "posix+cache")
    assert sum(r["disagree"] for r in ok) == 0, "every configuration ranks alike"


def test_bench_footprint(tiny_index: Path, results: Path, capsys) -> None:
    from benchmarks import bench_footprint

    assert bench_footprint.main(["--index", str(tiny_index), "--quick", "--n", "5"]) == 0
    payload = _check(results, "footprint", capsys)
    assert {r["reader"] for r in payload["runs"]} == {"posix", "memory", "mmap"}


def test_bench_rerank(results: Path, capsys, sample_index: Path, tmp_path: Path) -> None:
    """On the bundled sample corpus's queries and qrels, laid out as a BEIR directory."""
    import shutil

    from benchmarks import bench_rerank

    data = common.ROOT / "espn" / "data"
    (tmp_path / "qrels").mkdir()
    shutil.copy(data / "sample_queries.jsonl", tmp_path / "queries.jsonl")
    shutil.copy(data / "sample_qrels.tsv", tmp_path / "qrels" / "test.tsv")
    assert bench_rerank.main(["--index", str(sample_index), "--data", str(tmp_path), "--quick", "--limit", "10",
                              "--counts", "16,100"]) == 0
    payload = _check(results, "rerank", capsys)
    assert [r["rerank_count"] for r in payload["rows"]] == [16, 100]


@pytest.mark.slow
def test_bench_build(results: Path, capsys) -> None:
    from benchmarks import bench_build

    if not (common.SCIFACT / "corpus.jsonl.gz").is_file():
        pytest.skip(f"SciFact corpus not found at {common.SCIFACT}")
    pytest.importorskip("psutil")
    assert bench_build.main(["--quick", "--docs", "8"]) == 0
    payload = _check(results, "build", capsys)
    kinds = {(r["corpus"], r["kind"]) for r in payload["runs"]}
    assert kinds == {("x1", "bare"), ("x1", "build"), ("x2", "build")}


def test_bench_gpu_without_cuda_says_so_in_one_line(tmp_path: Path) -> None:
    # This machine has no GPU: the GPU run must refuse in one clear line and measure nothing.
    import subprocess

    from benchmarks import bench_gpu

    if bench_gpu.cuda_absent() is None:
        pytest.skip("CUDA is present: run `python -m benchmarks.bench_gpu` instead")
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu", "--index", str(tmp_path / "none")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "ESPN_BENCH_RESULTS": str(tmp_path / "results")})
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_gpu: ") and "CUDA is absent" in lines[0], done.stderr
    assert not (tmp_path / "results").exists()


def test_page_memory_measures_a_page_a_server_and_a_build(results: Path, capsys) -> None:
    """bench_page_memory's small cases: every step of a page measured, every write answered, the build done."""
    from benchmarks import bench_page_memory

    assert bench_page_memory.main(["--quick", "--name", "page_memory_quick"]) == 0
    payload = _check(results, "page_memory_quick", capsys, png=False)
    assert [step["mode"] for step in payload["steps"]] == ["1", "RGB", "RGBA"]
    assert all(step["page_peak"] > 0 for step in payload["steps"])
    server, build = payload["cases"]
    assert server["batch_status"] == 200 and server["put_statuses"] == [201, 201] and server["peak_rss"] > 0
    assert build["exit"] == 0 and build["peak_tree_rss"] > 0


def test_page_encoding_compares_a_device_with_the_cpu(results: Path, capsys) -> None:
    """bench_page_encoding, the GPU run's page study, on its CPU counterpart: the CPU against
    itself is exact (every difference 0, every grid equal), with several grids for ColQwen. On
    a GPU the same code measures autocast (`python -m benchmarks.bench_gpu`)."""
    from benchmarks import bench_page_encoding

    assert bench_page_encoding.main(["--device", "cpu", "--pages", "8", "--batch", "4", "--rounds", "1",
                                     "--name", "page_encoding_cpu"]) == 0
    rows = _check(results, "page_encoding_cpu", capsys, png=False)["rows"]
    assert [Path(row["model"]).name for row in rows] == ["tiny-colpali", "tiny-colqwen2"]
    for row in rows:
        assert row["max_abs_vector_error"] == 0.0 and row["max_relative_maxsim_error"] == 0.0
        assert row["grids_equal"] and row["top1_kept"] == row["queries"] and row["device_pages_per_s"] > 0
    assert rows[0]["distinct_grids"] == 1 and rows[1]["distinct_grids"] == len(bench_page_encoding.SHAPES)


def test_bench_compact_assembles_every_setting_from_one_encode(tiny_index: Path, tmp_path: Path) -> None:
    # The script's SciFact evaluation needs the data; its build path (chunks once, assemble per setting) runs here.
    from benchmarks import bench_compact

    from espn.index import read_manifest

    encoded = bench_compact.export_chunks(tiny_index, tmp_path / "encoded")
    assert bench_compact.assemble_setting(encoded, tmp_path / "pool2-int8", 2, "int8") > 0
    manifest = read_manifest(tmp_path / "pool2-int8")
    assert manifest["counts"]["documents"] == 2000
    assert (manifest["store"]["dtype"], manifest["store"]["pool_factor"]) == ("int8", 2)
    assert (tmp_path / "pool2-int8" / "embeddings.bin").stat().st_size < (tiny_index / "embeddings.bin").stat().st_size / 3
    (per_vector, _, error), (per_dim, _, _) = bench_compact.scale_errors(encoded, docs=50)
    assert per_vector.startswith("per vector") and per_dim == "per dimension" and 0 < error < 0.01


def test_bench_filter(tiny_index: Path, results: Path, capsys, tmp_path: Path) -> None:
    import shutil

    from benchmarks import bench_filter
    from benchmarks.make_synthetic import add_synthetic_metadata

    index = tmp_path / "tiny-with-metadata"  # a copy: the session's tiny index stays as built
    shutil.copytree(tiny_index, index)
    add_synthetic_metadata(index)
    queries = tiny_index.with_name(tiny_index.name + ".queries.npz")
    assert bench_filter.main(["--index", str(index), "--queries-npz", str(queries), "--quick"]) == 0
    payload = _check(results, "bench_filter", capsys, png=False)
    rows = payload["rows"]
    assert len(rows) == 2 * (1 + 2 * 5)  # (unfiltered + 2 fields x 5 selectivities) x prefetch on/off
    # 2,000 documents: the default nprobe scans every list, so every filtered search is exact.
    assert all(r["recall"] >= 0.99 for r in rows), rows


def test_bench_reopen(sample_index: Path, capsys) -> None:
    from benchmarks import bench_reopen

    assert bench_reopen.main(["--index", str(sample_index), "--quick"]) == 0
    out = capsys.readouterr().out
    assert "over 3 generations" in out and "the per-request check" in out
    assert not (sample_index / "live").exists()  # it works on a copy


def test_bench_updates(sample_index: Path, results: Path, capsys) -> None:
    from benchmarks import bench_updates

    data = common.ROOT / "espn" / "data"
    assert bench_updates.main(["--index", str(sample_index), "--corpus", str(data / "sample_corpus.jsonl"),
                               "--queries", str(data / "sample_queries.jsonl"), "--quick"]) == 0
    payload = _check(results, "bench_updates_quick", capsys, png=False)
    assert list(payload["search"]) == ["0 deltas", "1 deltas", "2 deltas", "2 deltas + 10% deleted", "compacted"]
    assert payload["search"]["2 deltas"]["segments"] == 2 and payload["search"]["compacted"]["segments"] == 0
    assert not (sample_index / "live").exists()


def test_bench_server(sample_index: Path, tmp_path: Path, capsys) -> None:
    from benchmarks import bench_server

    data = common.ROOT / "espn" / "data"
    out = tmp_path / "server.json"
    assert bench_server.main(["--index", str(sample_index), "--queries", str(data / "sample_queries.jsonl"),
                              "--qrels", str(data / "sample_qrels.tsv"), "--quick", "--json", str(out)]) == 0
    assert "|---" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert set(payload["memory"]) == {"1"} and payload["memory"]["1"]["pss_total"] > 0
    assert {key: (row["errors"], row["requests"]) for key, row in payload["load"].items()} == {"1x1": (0, 20),
                                                                                           "1x4": (0, 20)}


def test_bench_http_floor(results: Path, capsys) -> None:
    from benchmarks import bench_http_floor

    assert bench_http_floor.main(["--rounds", "1", "--requests", "20"]) == 0
    payload = _check(results, "http_floor", capsys, png=False)
    assert set(payload["p50_ms"]) == {"h11", "httptools"}
    assert all(len(values) == 1 and values[0] > 0 for values in payload["p50_ms"].values())
    assert payload["loopback_ms"][0] > 0


def test_bench_readers_under_cpu_load(tiny_index: Path, results: Path, capsys) -> None:
    from benchmarks import bench_readers

    queries = tiny_index.with_name(tiny_index.name + ".queries.npz")
    assert bench_readers.main(["--index", str(tiny_index), "--queries-npz", str(queries), "--quick", "--batches", "1,4",
                               "--cpu-load", "1", "--every-wave"]) == 0
    payload = _check(results, "readers", capsys, png=False)
    assert payload["load"].startswith("1 CPU-bound process")
    configs = payload["configs"]
    assert {"memory/on/B1", "posix/off/B4", "posix, every wave/on/B1", "posix, every wave on a worker/on/B4"} \
        <= set(configs)
    assert all(cell["round_qps"][0] > 0 for cell in configs.values())
    # The cost model off: every search of the tiny index takes its waves, whatever they cost.
    assert configs["posix, every wave/on/B1"]["waves"] > 0 and configs["posix/off/B1"]["waves"] == 0


def test_bench_query_text_to_hits(sample_index: Path, results: Path, capsys) -> None:
    from benchmarks import bench_query

    data = common.ROOT / "espn" / "data"
    argv = ["--index", str(sample_index), "--queries", str(data / "sample_queries.jsonl"),
            "--qrels", str(data / "sample_qrels.tsv"), "--quick", "--n", "8"]
    assert bench_query.main(argv) == 0
    out = capsys.readouterr().out
    assert "| text/posix |" in out and "| encoder only |" in out and "onnxruntime" in out
    payload = json.loads((results / "query.json").read_text())
    assert 0 < payload["configs"]["text/memory"]["share"][0] < 1
    assert 0 <= payload["configs"]["text/posix"]["ndcg10"] <= 1
def test_bench_writes(tiny_index: Path, results: Path, capsys, sample_index: Path, tmp_path: Path) -> None:
    """A served copy of the sample index (it has a text encoder) takes sequential and concurrent
    PUTs, searches and a compaction; deletes run on a live copy of the tiny index."""
    from benchmarks import bench_writes

    data = common.ROOT / "espn" / "data"
    assert bench_writes.main(["--index", str(sample_index), "--corpus", str(data / "sample_corpus.jsonl"),
                              "--queries", str(data / "sample_queries.jsonl"), "--large", str(tiny_index),
                              "--work", str(tmp_path / "work"), "--quick", "--writers", "4", "--searchers", "2"]) == 0
    payload = _check(results, "bench_writes_quick", capsys, png=False)
    assert payload["sequential_puts"]["statuses"] == {"201": 12}
    assert payload["writes_alone"]["errors_5xx"] == 0 and payload["writes_alone"]["per_s"] > 0
    assert payload["compaction"]["compactions"] >= 1 and payload["server_log_tracebacks"] == 0
    assert payload["deletes"]["deletes"] == 5 and payload["deletes"]["max_write_bytes"] < 65536
    assert payload["deletes"]["documents"] == 2000
    assert not (sample_index / "live").exists() and not (tiny_index / "live").exists()  # copies took the writes
def _sample_beir(tmp_path: Path) -> Path:
    """The bundled sample corpus's queries and qrels, laid out as a BEIR directory (test split)."""
    data = common.ROOT / "espn" / "data"
    (tmp_path / "qrels").mkdir()
    shutil.copy(data / "sample_queries.jsonl", tmp_path / "queries.jsonl")
    shutil.copy(data / "sample_qrels.tsv", tmp_path / "qrels" / "test.tsv")
    return tmp_path


def test_bench_hybrid(results: Path, capsys, sample_index: Path, tmp_path: Path) -> None:
    from benchmarks import bench_hybrid

    beir = _sample_beir(tmp_path)
    assert bench_hybrid.main(["effectiveness", "--index", str(sample_index), "--data", str(beir), "--splits", "test",
                              "--quick", "--limit", "12"]) == 0
    payload = _check(results, "hybrid_effectiveness", capsys, png=False)
    rows = payload["splits"]["test"]["nDCG@10"]
    assert {"dense", "lexical", "rrf/union", "rrf/lists", "mix 0.65/union"} <= set(rows)
    assert all(0.0 <= value <= 1.0 for value in rows.values())


def test_bench_hybrid_on_a_synthetic_index_with_text(results: Path, capsys, sample_index: Path,
                                                     tmp_path: Path) -> None:
    """make_synthetic --text: recombined passages and a full-text index; the latency bench then
    searches it with precomputed query embeddings and the query texts it wrote."""
    from benchmarks import bench_hybrid, bench_text_engines
    from benchmarks.make_synthetic import generate

    out = tmp_path / "synth"
    generate(out, 600, sample_index, queries=12, chunk_size=256, nlist=8, ann="flat", text=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["text"]["documents"] == 600
    texts = out.with_name("synth.query_texts.jsonl").read_text().splitlines()
    assert len(texts) == 12 and all(json.loads(line)["text"] for line in texts)
    assert bench_hybrid.main(["latency", "--index", str(out), "--quick", "--query-embeddings",
                              str(out.with_name("synth.queries.npz")),
                              "--query-texts", str(out.with_name("synth.query_texts.jsonl"))]) == 0
    payload = _check(results, "hybrid_latency", capsys, png=False)
    assert payload["queries"] == 5 and payload["ratio_p50"] > 0
    pytest.importorskip("bm25s")
    assert bench_text_engines.main(["--index", str(out), "--queries", str(out.with_name("synth.query_texts.jsonl")),
                                    "--no-qrels", "--quick"]) == 0
    payload = _check(results, "text_engines", capsys, png=False)
    assert [row["engine"] for row in payload["rows"]] == ["tantivy", "bm25s"]
    assert all(row["documents"] == 600 and row["bytes"] > 0 for row in payload["rows"])


def test_bench_text_writes(sample_index: Path, results: Path, capsys) -> None:
    from benchmarks import bench_text_writes

    data = common.ROOT / "espn" / "data"
    assert bench_text_writes.main(["--index", str(sample_index), "--corpus", str(data / "sample_corpus.jsonl"),
                                   "--quick"]) == 0
    payload = _check(results, "bench_text_writes_quick", capsys, png=False)
    assert set(payload["summary"]) == {"text", "dense only"} and payload["ratio"]["docs_per_s"] > 0
    assert not (sample_index / "live").exists()


@pytest.mark.slow
def test_bench_replication(sample_index: Path, results: Path, capsys, tmp_path: Path) -> None:
    pytest.importorskip("moto.server")
    from benchmarks import bench_replication
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps({"_id": str(i), "text": q}) + "\n"
                               for i, q in enumerate(["rivers and floods", "bread baking", "train timetables"])))
    # The search study's four servers are left out here: test_router.py serves the same router over
    # the same partitions and compares its rankings, which is what that study times.
    assert bench_replication.main(["--index", str(sample_index), "--quick", "--query-file", str(queries),
                                   "--studies", "catch-up,lag,ack"]) == 0
    payload = _check(results, "replication", capsys, png=False)
    assert payload["lag"][0]["writes"] == 4 and payload["lag"][0]["failed"] == 0
    assert payload["catch_up_s"]["median"] > 0 and "search_p50_ms" not in payload
    assert all(row["writes_per_s"] > 0 and row["p50_ms"] > 0 for row in payload["ack"].values())


def test_bench_explain(sample_index: Path, results: Path, capsys) -> None:
    from benchmarks import bench_explain

    data = common.ROOT / "espn" / "data"
    assert bench_explain.main(["--index", str(sample_index), "--queries", str(data / "sample_queries.jsonl"),
                               "--qrels", str(data / "sample_qrels.tsv"), "--quick"]) == 0
    payload = _check(results, "explain", capsys, png=False)
    explained = payload["configs"]["search + explain"]
    assert payload["ratio"] > 0 and explained["explain_p50"][0] > 0
    assert not any(payload["configs"]["search"]["explain_p50"])  # no explain stage when it is not asked for


def test_bench_maxsim(sample_index: Path, results: Path, capsys) -> None:
    """The kernel and the torch fallback timed on the records of real searches, agreeing."""
    from benchmarks import bench_maxsim
    from espn.search import scoring

    scored_by = scoring.score_records
    data = common.ROOT / "espn" / "data"
    assert bench_maxsim.main(["--index", str(sample_index), "--queries", str(data / "sample_queries.jsonl"),
                              "--n", "3"]) == 0
    assert scoring.score_records is scored_by  # the interception is undone
    payload = _check(results, "maxsim_kernel", capsys, png=False)
    assert payload["calls"] == 3 and payload["pairs_per_call"] > 0
    assert payload["kernel_ms"] > 0 and payload["torch_ms"] > 0
    assert payload["max_abs_difference"] < 1e-4


def test_bench_lexical(results: Path, capsys, tmp_path: Path) -> None:
    """espn's lexical side against bm25s on the sample corpus (the SciFact run is the same code)."""
    pytest.importorskip("bm25s")
    from benchmarks import bench_lexical

    beir = _sample_beir(tmp_path)
    shutil.copy(common.ROOT / "espn" / "data" / "sample_corpus.jsonl", beir / "corpus.jsonl")
    assert bench_lexical.main(["--data", str(beir), "--splits", "test"]) == 0
    payload = _check(results, "lexical_vs_bm25s", capsys, png=False)
    rows = payload["nDCG@10"]
    assert len(rows) == 4 and all(0.0 < row["test"] <= 1.0 for row in rows.values())


def test_bench_first_stage(results: Path, capsys, tmp_path: Path) -> None:
    """The bundled sample corpus through the precomputed token model: every first stage's row,
    the exhaustive reference at ratio 1, and the served searches' latencies."""
    from benchmarks import bench_first_stage

    assert bench_first_stage.main(["--quick", "--model", "tokens", "--work", str(tmp_path / "work")]) == 0
    payload = _check(results, "first_stage_quick", capsys, png=False)
    rows = payload["splits"]["test"]["rows"]
    assert rows[0]["setting"] == {"kind": "exhaustive"} and rows[0]["recall@10"] == 1.0
    assert {r["setting"]["kind"] for r in rows} == {"exhaustive", "centroids", "ivf", "text"}
    assert set(payload["latency_p50_ms"]) >= {"centroids (default)", "exhaustive MaxSim"}
    assert payload["first_stage_ram_bytes"] > 0


def test_bench_pages_on_a_tiny_page_index(results: Path, capsys, sample_index: Path, tmp_path: Path) -> None:
    """make_synthetic's page mode (a ColPali-class index: int8, pure MaxSim, the centroid first
    stage by default) and bench_pages on it: every setting's recall, both readers' latencies."""
    from benchmarks import bench_pages
    from benchmarks.make_synthetic import generate

    out = tmp_path / "pages"
    info = generate(out, 50, sample_index, d_bow=128, queries=8, chunk_size=20, nlist=4, ann="flat", patches=64)
    manifest = json.loads((out / "manifest.json").read_text())
    assert info["bow_vectors"] == 50 * 64 and manifest["store"]["dtype"] == "int8"
    assert manifest["first_stage"]["kind"] == "centroids" and manifest["encoder"]["learned_weight"] == 0.0
    assert manifest["first_stage"]["probe"] == PAGE_FIRST_STAGE.probe  # what `espn index` gives pages
    assert bench_pages.main(["--index", str(out), "--quick"]) == 0
    payload = _check(results, "pages_quick", capsys, png=False)
    assert {r["setting"]["kind"] for r in payload["recall"]["rows"]} == {"centroids", "ivf", "union"}
    assert all(0.0 <= r["recall@10"] <= 1.0 for r in payload["recall"]["rows"])
    assert 0.0 < payload["recall"]["default_served_recall@10"] <= 1.0
    assert set(payload["latency"]) == {"posix", "memory"} and payload["latency"]["posix"]["p50_ms"] > 0
    assert payload["footprint"]["records_bytes_per_page"] > 64 * 128


def test_token_mode_draws_real_lengths_into_a_residual_colbert_class_index(results: Path, capsys,
                                                                            sample_index: Path, tmp_path: Path) -> None:
    """make_synthetic's token mode (issue 46's scale corpus): ColBERT-class documents whose lengths
    are the source's, in residual records under the centroid first stage; bench_pages measures
    its first stages against the exhaustive MaxSim and both readers, as for pages."""
    from benchmarks import bench_pages
    from benchmarks.make_synthetic import generate, load_centres

    out = tmp_path / "tokens"
    info = generate(out, 120, sample_index, d_bow=128, queries=8, chunk_size=50, nlist=4, ann="flat", tokens=True,
                    bow_dtype="residual4")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["store"]["dtype"] == "residual4" and manifest["first_stage"]["kind"] == "centroids"
    assert manifest["encoder"]["learned_weight"] == 0.0 and manifest["encoder"]["d_bow"] == 128
    lengths = set(load_centres(sample_index, 128, 128, widen=True)["count"].tolist())
    records = np.load(out / "records.npy")
    assert set(records["n_bow"].tolist()) <= lengths and len(set(records["n_bow"].tolist())) > 5
    assert info["bow_vectors"] == int(records["n_bow"].sum())
    assert bench_pages.main(["--index", str(out), "--quick", "--name", "tokens_quick"]) == 0
    payload = _check(results, "tokens_quick", capsys, png=False)
    assert 0.0 < payload["recall"]["default_served_recall@10"] <= 1.0
    assert set(payload["latency"]) == {"posix", "memory"} and payload["latency"]["posix"]["p50_ms"] > 0


def test_bench_query_encoders(results: Path, capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import bench_query_encoders

    monkeypatch.setenv("HOME", str(tmp_path))  # the ONNX graph cache
    assert bench_query_encoders.main(["--quick", "--models", "bert", "--fidelity-index",
                                      str(tmp_path / "fidelity" / "index")]) == 0
    out = capsys.readouterr().out
    assert "| bert | 2 | onnx int8 |" in out and "mean overlap" in out
    payload = json.loads((results / "query_encoders.json").read_text())
    assert {(row["backend"], row["threads"]) for row in payload["rows"]} == {
        (backend, threads) for backend in bench_query_encoders.BACKENDS for threads in bench_query_encoders.THREADS}
    assert 0 <= payload["fidelity"]["top10_overlap"] <= 1


def test_bench_growth(results: Path, capsys, sample_index: Path, tmp_path: Path) -> None:
    """An index created empty grown by writes of synthetic token documents (with the server's
    compaction) against fresh builds, then the exact first stage against the fitted one."""
    from benchmarks import bench_growth
    from espn.live.compaction import CompactionPolicy
    from espn.live.fitting import EXACT_MAX_DOCUMENTS

    assert bench_growth.main(["growth", "--quick", "--source", str(sample_index), "--work", str(tmp_path / "g")]) == 0
    payload = _check(results, "growth_growth_quick", capsys, png=False)
    rows = payload["growth"]["rows"]
    assert [row["documents"] >= size for row, size in zip(rows, (200, 600))] == [True, True]
    small, large = rows
    # below EXACT_MAX_DOCUMENTS the grown index is exact: the exhaustive ranking itself
    assert small["documents"] < EXACT_MAX_DOCUMENTS and small["stats"]["exact"]
    assert small["search"]["grown"]["recall@10"] == 1.0
    # past it, once the writes stop, the compactions the policy asks for leave it fitted, and no rewrite due
    assert large["documents"] >= EXACT_MAX_DOCUMENTS and not large["stats"]["exact"]
    assert large["stats"]["growth_since_fit"] <= CompactionPolicy().base_ratio
    for row in rows:
        assert row["search"]["grown"]["documents"] == row["documents"]
        assert row["search"]["fresh build"]["documents"] == row["documents"] and row["p50_ratio"] > 0
        assert row["throughput"]["during_refit"][0]["docs"] > 0 and row["throughput_ratio"] > 0
    assert bench_growth.main(["exact", "--quick", "--source", str(sample_index), "--work", str(tmp_path / "e")]) == 0
    payload = _check(results, "growth_exact_quick", capsys, png=False)
    assert set(payload["exact"]) == {"tokens", "text"}
    for study in payload["exact"].values():
        assert [row["documents"] for row in study["rows"]] == [200, 600]
        assert all(row["search"]["exact"]["recall@10"] == 1.0 for row in study["rows"])


def test_bench_create(results: Path, capsys, sample_index: Path, tmp_path: Path) -> None:
    """A server with only an index root creates indexes over HTTP; one is filled by writes and
    ranked with `espn search --qrels` beside an `espn index` of the sample corpus."""
    from benchmarks import bench_create

    assert bench_create.main(["create", "--quick", "--work", str(tmp_path / "c")]) == 0
    payload = _check(results, "create_create_quick", capsys, png=False)
    assert len(payload["http"]["text"]["s"]) == 2 and payload["http"]["text"]["p50_s"] > 0
    assert payload["library"]["text"]["p50_s"] > 0
    assert bench_create.main(["quality", "--quick", "--built", f"text={sample_index}",
                              "--work", str(tmp_path / "q")]) == 0
    row = _check(results, "create_quality_quick", capsys, png=False)["rows"]["text"]
    assert row["created"]["stored"]["documents"] == 40 and row["refitted"]["stored"]["deltas"] == 0
    assert row["created"]["stored"]["d_bow"] == 384 and row["built"]["stored"]["d_bow"] == 64  # unprojected vs PCA
    assert 0 < row["created"]["measures"]["nDCG@10"] <= 1 and row["built"]["stored"]["documents"] == 300
