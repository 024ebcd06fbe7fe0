"""Page search with a ColPali-class model: the visual encoder against Sentence Transformers' own encode,
a page index built by `espn index` against the library's MaxSim, and the refusals around them.

The model is benchmarks.make_visual_checkpoint's tiny seeded ColPali (64 px pages, 8 px patches:
64 patch vectors and the visual prompt's few per page), made once for the module.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from PIL import Image
from sentence_transformers import MultiVectorEncoder

from benchmarks.bench_visual import QUERIES, draw_page
from espn import Searcher
from espn.choices import PAGE_DPI
from espn.cli import OWN_LOGGERS, main
from espn.encoders import encoder_from_spec, load_encoder
from espn.encoders.st_format import is_sentence_transformers_save, is_visual_save
from espn.encoders.visual import VisualEncoder
from espn.errors import CorpusError, InvalidParameterError, RefusedInputError
from espn.pages.corpus import DEFAULT_DPI, MAX_DPI, MIN_DPI, Page, iter_pages
from espn_indexing.build import default_pool_factor
from espn_indexing.chunks import chunk_path, read_chunk
from espn_indexing.pages import encode_page_corpus, page_metadata

from helpers import assert_tokens_map_to_their_characters, visual_encoder, visual_library

#: The issue's bound for stored (float16) records against the library's fp32 MaxSim.
RELATIVE = 0.005


@pytest.fixture(scope="module")
def library(colpali_checkpoint: Path) -> MultiVectorEncoder:
    return visual_library(colpali_checkpoint)


@pytest.fixture(scope="module")
def encoder(colpali_checkpoint: Path) -> VisualEncoder:
    return visual_encoder(colpali_checkpoint)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 PNG pages in two folders and a 2-page PDF: 12 pages."""
    root = tmp_path_factory.mktemp("pages")
    for number in range(10):
        folder = root / ("scans" if number < 5 else "more")
        folder.mkdir(exist_ok=True)
        draw_page(number).save(folder / f"p{number:02d}.png")
    first, second = draw_page(10, (200, 260)), draw_page(11, (200, 260))
    first.save(root / "report.pdf", save_all=True, append_images=[second], resolution=72.0)
    return root


@pytest.fixture(scope="module")
def index(corpus: Path, colpali_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built by the `espn index` command, float16 records, chunks of 5 pages."""
    return _build_pages(corpus, colpali_checkpoint, tmp_path_factory.mktemp("idx") / "pages", "float16")


def _build_pages(corpus: Path, colpali_checkpoint: Path, out: Path, dtype: str) -> Path:
    """`espn index` over the page corpus with `--bow-dtype dtype`, chunks of 5 pages."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in OWN_LOGGERS}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("ESPN_")})
        status = main(["index", str(corpus), "--out", str(out), "--encoder", f"colbert:{colpali_checkpoint}",
                       "--bow-dtype", dtype, "--chunk-size", "5", "--batch-size", "4", "--dpi", "72",
                       "--loader-workers", "1", "--no-progress", "--device", "cpu"])
    root.handlers[:], root.level = handlers, level
    for name, value in levels.items():
        logging.getLogger(name).setLevel(value)
    assert status == 0
    return out


def test_the_cli_defaults_are_the_page_readers() -> None:
    assert PAGE_DPI == (MIN_DPI, MAX_DPI, DEFAULT_DPI)


def test_the_checkpoint_is_a_visual_sentence_transformers_save(colpali_checkpoint: Path) -> None:
    assert is_sentence_transformers_save(colpali_checkpoint) and is_visual_save(colpali_checkpoint)
    assert sum(f.stat().st_size for f in colpali_checkpoint.rglob("*") if f.is_file()) < 4 << 20
    for spec in (f"visual:{colpali_checkpoint}", f"hf:{colpali_checkpoint}"):  # hf: is never the text recipe on it
        assert isinstance(encoder_from_spec(spec, device="cpu"), VisualEncoder)
        assert default_pool_factor(spec) == 1
    text_model = Path(__file__).resolve().parents[1] / "espn" / "data"
    with pytest.raises(InvalidParameterError, match="not a checkpoint whose documents are images"):
        encoder_from_spec(f"visual:{text_model}", device="cpu")


def test_query_and_page_vectors_are_the_librarys(encoder: VisualEncoder, library: MultiVectorEncoder) -> None:
    pages = [draw_page(n) for n in range(5)] + [draw_page(7, (300, 90))]
    expected = library.encode_document(pages)
    found = encoder.encode_pages(pages)
    assert [len(bow) for _, bow in found.split()] == [len(e) for e in expected]
    assert len(expected[0]) > 64  # the patches and the visual prompt
    for (cls, bow), reference in zip(found.split(), expected):
        np.testing.assert_allclose(bow, reference.numpy(), atol=1e-5, rtol=0)
        mean = reference.numpy().sum(0)
        np.testing.assert_allclose(cls, mean / np.linalg.norm(mean), atol=1e-5)
    queries = encoder.encode_queries(QUERIES)
    for row, reference in enumerate(library.encode_query(QUERIES)):
        kept = queries.bow[row][queries.mask[row]]
        assert kept.shape == tuple(reference.shape)
        np.testing.assert_allclose(kept, reference.numpy(), atol=1e-5, rtol=0)


def test_text_documents_are_refused(encoder: VisualEncoder) -> None:
    for call in (lambda: encoder.encode_documents(["a passage"]), lambda: encoder.tokenize(["x"], is_query=False)):
        with pytest.raises(InvalidParameterError, match="a visual index takes pages: ") as caught:
            call()
        assert "\n" not in str(caught.value)


def test_the_index_ranks_as_the_librarys_maxsim(index: Path, corpus: Path, library: MultiVectorEncoder) -> None:
    pages = list(iter_pages(corpus, dpi=72))
    assert len(pages) == 12
    reference = library.similarity(library.encode_query(QUERIES), library.encode_document([p.image for p in pages]))
    reference = reference.numpy()
    position = {page.id: i for i, page in enumerate(pages)}
    with Searcher.open(index) as searcher:
        assert searcher.num_documents == 12
        exhaustive = searcher.search_maxsim_exhaustive(searcher.encode(QUERIES), k=12)
        served = searcher.search(QUERIES, k=3)
    decided = 0  # queries whose library top 1 leads by more than twice the bound: their top 1 must agree
    for row, (hits, result) in enumerate(zip(exhaustive, served)):
        assert len(hits) == 12
        for hit in hits:
            expected = reference[row, position[hit.doc_id]]
            assert abs(hit.score - expected) <= RELATIVE * abs(expected), (QUERIES[row], hit.doc_id)
        order = np.argsort(-reference[row])
        if reference[row, order[0]] - reference[row, order[1]] > 2 * RELATIVE * reference[row, order[0]]:
            assert hits[0].doc_id == pages[order[0]].id == result.hits[0].doc_id
            decided += 1
    assert decided >= 3


def test_pages_stored_as_residual_records_rank_as_their_float16_index(
        index: Path, corpus: Path, colpali_checkpoint: Path, tmp_path: Path) -> None:
    """A page index of residual4 records (patch vectors coded against its centroids): smaller, its
    scores within a tenth of the float16 index's, the same top page wherever the float16 ranking
    is decided by more than that error, and the default search serving its exhaustive top 3."""
    residual = _build_pages(corpus, colpali_checkpoint, tmp_path / "residual", "residual4")
    stored = {path: json.loads((path / "manifest.json").read_text())["store"] for path in (index, residual)}
    assert stored[residual]["dtype"] == "residual4" and stored[residual]["file_bytes"] < stored[index]["file_bytes"]
    with Searcher.open(index) as exact, Searcher.open(residual) as coded:
        queries = exact.encode(QUERIES)
        reference = exact.search_maxsim_exhaustive(queries, k=12)
        found = coded.search_maxsim_exhaustive(queries, k=12)
        served = coded.search(QUERIES, k=3)
    overlaps = []
    for ref, got, result in zip(reference, found, served):
        scores = {h.doc_id: h.score for h in got}
        errors = [abs(scores[h.doc_id] - h.score) for h in ref]
        assert max(errors) < 0.1 * abs(ref[0].score)  # measured: at most 0.054 of the score
        if ref[0].score - ref[1].score > 2 * max(errors):  # decided beyond what the codec can move
            assert got[0].doc_id == ref[0].doc_id
        assert [h.doc_id for h in result.hits] == [h.doc_id for h in got[:3]]
        overlaps.append(len({h.doc_id for h in ref[:3]} & {h.doc_id for h in got[:3]}) / 3)
    assert np.mean(overlaps) >= 0.7  # measured: 0.79 (19 of 24 top-3 pages)


def test_the_index_reopens_and_espn_search_writes_a_run(index: Path, tmp_path: Path) -> None:
    manifest = json.loads((index / "manifest.json").read_text())
    assert manifest["encoder"]["kind"] == "visual" and manifest["encoder"]["modality"] == "image"
    model = index / "encoder" / "model"
    assert all(not p.is_symlink() for p in model.rglob("*"))
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(json.dumps({"_id": f"q{i}", "text": q}) + "\n" for i, q in enumerate(QUERIES)))
    run = tmp_path / "run.trec"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("ESPN_")})
        assert main(["search", str(index), "--queries", str(queries), "--out", str(run), "--k", "5"]) == 0
    lines = [line.split() for line in run.read_text().splitlines()]
    assert len(lines) == 5 * len(QUERIES) and {line[0] for line in lines} == {f"q{i}" for i in range(len(QUERIES))}
    with Searcher.open(index) as searcher:
        document = searcher.document("report.pdf#2")
    assert document.text == "page 2 of report.pdf" and document.title == "report.pdf"
    assert document.metadata == {"source": "report.pdf", "page": 2}


def test_page_metadata_keeps_the_records_own_fields() -> None:
    image = Image.new("RGB", (8, 8))
    page = Page(id="x", source="a/b.pdf", page_number=3, metadata={"page": "iii", "lang": "en"}, image=image)
    assert page_metadata(page) == {"source": "a/b.pdf", "page": "iii", "lang": "en"}


def test_a_rerun_encodes_only_missing_chunks_and_the_worker_changes_nothing(
        corpus: Path, encoder: VisualEncoder, tmp_path: Path) -> None:
    """The first run prepares pages in a loader worker, the rerun in-process (the reference)."""
    totals = encode_page_corpus(corpus, tmp_path, encoder, dpi=72, chunk_size=5, batch_size=3, progress=False,
                                loader_workers=1)
    assert totals == {"documents": 12, "chunks": 3}
    first = read_chunk(tmp_path, 1)
    chunk_path(tmp_path, 1).unlink()
    stamps = {i: chunk_path(tmp_path, i).stat().st_mtime_ns for i in (0, 2)}
    assert encode_page_corpus(corpus, tmp_path, encoder, dpi=72, chunk_size=5, batch_size=3, progress=False,
                              loader_workers=0) == totals
    assert {i: chunk_path(tmp_path, i).stat().st_mtime_ns for i in (0, 2)} == stamps
    again = read_chunk(tmp_path, 1)
    assert list(again.ids) == list(first.ids) and np.array_equal(again.counts, first.counts)
    assert np.array_equal(again.bow, first.bow) and np.array_equal(again.docs_blob, first.docs_blob)


def test_a_bad_page_is_one_line_from_the_worker(corpus: Path, encoder: VisualEncoder, tmp_path: Path) -> None:
    pages = tmp_path / "pages"
    shutil.copytree(corpus, pages)
    (pages / "scans" / "p02.png").write_bytes(b"not a png")
    with pytest.raises(CorpusError, match="p02.png") as caught:
        encode_page_corpus(pages, tmp_path / "work", encoder, dpi=72, chunk_size=5, progress=False, loader_workers=1)
    assert "\n" not in str(caught.value)
    totals = encode_page_corpus(pages, tmp_path / "work", encoder, dpi=72, chunk_size=5, progress=False,
                                loader_workers=1, skip_bad=True)
    assert totals == {"documents": 11, "chunks": 3}


@pytest.fixture()
def quiet_cli() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in OWN_LOGGERS}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("ESPN_")})
        yield
    root.handlers[:], root.level = handlers, level
    for name, value in levels.items():
        logging.getLogger(name).setLevel(value)


def test_a_text_encoder_over_pages_and_a_visual_encoder_over_text_fail_in_one_line(
        corpus: Path, colpali_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        quiet_cli: None) -> None:
    text = tmp_path / "corpus.jsonl"
    text.write_text(json.dumps({"_id": "d1", "title": "", "text": "a passage of text"}) + "\n")
    cases = [(corpus, "minilm", "is a page corpus (images or PDFs) but the hf encoder reads text"),
             (text, f"colbert:{colpali_checkpoint}", "a visual index takes pages: ")]
    for source, spec, message in cases:
        out = tmp_path / f"out-{spec.partition(':')[0]}"
        assert main(["index", str(source), "--out", str(out), "--encoder", spec, "--no-progress",
                     "--loader-workers", "0", "--device", "cpu"]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
        assert not out.exists() and not Path(f"{out}.partial").exists()


def test_deeply_nested_json_in_pages_or_model_is_one_line_and_nothing_written(
        corpus: Path, colpali_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        quiet_cli: None) -> None:
    """A page JSONL line or a model directory's JSON file of 100,000 brackets: refused before Python's
    recursive parser sees it (a RecursionError would be a traceback), and no index is started."""
    deep = "[" * 100_000 + "]" * 100_000
    pages = tmp_path / "pages.jsonl"
    draw_page(0).save(tmp_path / "one.png")
    pages.write_text('{"_id": "a", "image": "one.png"}\n{"_id": "b", "image": "one.png", "metadata": ' + deep + "}\n")
    models = {}
    for name in ("config.json", "modules.json"):
        models[name] = tmp_path / f"model-{name}"
        shutil.copytree(colpali_checkpoint, models[name])
        (models[name] / name).write_text(deep)
    cases = [(pages, colpali_checkpoint, f"{pages}:2: refused, JSON nested 100001 levels deep (at most 64)"),
             (corpus, models["config.json"], "refused, JSON nested 100000 levels deep (at most 64)"),
             (corpus, models["modules.json"], "refused, JSON nested 100000 levels deep (at most 64)")]
    for number, (source, model, message) in enumerate(cases):
        out = tmp_path / f"out-{number}"
        assert main(["index", str(source), "--out", str(out), "--encoder", f"colbert:{model}", "--no-progress",
                     "--loader-workers", "0", "--device", "cpu"]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
        # No index; a bad page leaves the build's work folder for a resume, as a bad text line does
        # (tests/test_build.py), but nothing in it was encoded.
        assert not out.exists() and not Path(f"{out}.partial", "chunks").exists()


def test_the_model_directory_rules_hold_for_the_visual_kind(colpali_checkpoint: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    shutil.copy2(colpali_checkpoint / "tokenizer.json", outside)
    linked = tmp_path / "linked"
    shutil.copytree(colpali_checkpoint, linked)
    (linked / "tokenizer.json").unlink()
    (linked / "tokenizer.json").symlink_to(outside)
    for spec in (f"colbert:{linked}", f"visual:{linked}"):
        with pytest.raises(RefusedInputError, match="tokenizer.json"):
            encoder_from_spec(spec, device="cpu")
    remote = tmp_path / "remote"
    shutil.copytree(colpali_checkpoint, remote)
    config = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "evil.Model"}}))
    with pytest.raises(RefusedInputError, match="trust-remote-code|remote code"):
        encoder_from_spec(f"visual:{remote}", device="cpu")


def test_the_saved_encoder_reloads_offline_and_encodes_the_same(encoder: VisualEncoder, tmp_path: Path) -> None:
    encoder.save(tmp_path)
    again = load_encoder(tmp_path, encoder.config(), device="cpu")
    assert isinstance(again, VisualEncoder)
    page = [draw_page(3)]
    assert np.array_equal(again.encode_pages(page).bow, encoder.encode_pages(page).bow)
    with torch.inference_mode():
        assert np.array_equal(again.encode_queries(QUERIES[:2]).bow, encoder.encode_queries(QUERIES[:2]).bow)


def test_explained_query_tokens_map_to_the_characters_they_came_from(encoder: VisualEncoder) -> None:
    """The processor frames a query as BOS, its prefix ("Question: "), the query, padding: every query
    token is text with its own characters, the first one included (it was once read as the prefix)."""
    queries = ["quarterly revenue table", "  A Red circle? on page 2"]
    mask = encoder.encode_queries(queries).mask
    labels = encoder.query_tokens(queries, mask)
    ids = encoder.tokenize(queries, is_query=True)["input_ids"]
    tokenizer = encoder.model[0].processor.tokenizer
    assert labels is not None
    for row, query in enumerate(queries):
        kept = ids[row][torch.from_numpy(mask[row])].tolist()
        text = [(entry, token) for entry, token in zip(labels[row], kept) if entry[0] == "text"]
        assert [kind for kind, *_ in labels[row]].index("text") > 0  # the prefix and BOS come first
        assert all(entry[1] == query[entry[2]:entry[3]] for entry, _ in text)
        assert_tokens_map_to_their_characters(query, [(entry[2], entry[3]) for entry, _ in text],
                                              [tokenizer.decode([token]).strip() for _, token in text])
    assert labels[0][[kind for kind, *_ in labels[0]].index("text")] == ("text", "qu", 0, 2)


def test_a_refused_pdf_or_image_given_alone_says_why_and_a_scan_is_read_by_its_first_bytes(
        colpali_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet_cli: None) -> None:
    """`espn index FILE` of one file that gives no page names that file's refusal in one line, never
    "the corpus has no pages" (nor, for an image type that is not read, a text corpus's UTF-8
    error); a PNG without a suffix is a page."""
    from test_pages import write_encrypted_pdf, write_pdf

    write_encrypted_pdf(tmp_path / "locked.pdf", b"secret")
    (tmp_path / "notes.pdf").write_text("meeting notes, not a PDF\n")
    write_pdf(tmp_path / "million.pdf", [b"<< /Type /Catalog /Pages 2 0 R >>",
                                         b"<< /Type /Pages /Kids [3 0 R] /Count 1000000 >>",
                                         b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 100] >>"], b"/Root 1 0 R")
    draw_page(1).save(tmp_path / "scan.tiff")
    draw_page(2).save(tmp_path / "fax", format="TIFF")
    draw_page(3).save(tmp_path / "scan", format="PNG")
    cases = {"locked.pdf": "locked.pdf: refused, the PDF is encrypted (it needs a password)",
             "notes.pdf": "notes.pdf: not a readable PDF (",
             "million.pdf": "million.pdf: refused, 1000000 pages (at most 10000 a PDF)",
             "scan.tiff": "scan.tiff: refused, a TIFF image; pages are read from PNG, JPEG, WebP and PDF files",
             "fax": "fax: refused, a TIFF image; pages are read from PNG, JPEG, WebP and PDF files"}
    for name, message in cases.items():
        out = tmp_path / f"out-{name}"
        assert main(["index", str(tmp_path / name), "--out", str(out), "--encoder", f"visual:{colpali_checkpoint}",
                     "--no-progress", "--loader-workers", "0", "--device", "cpu"]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (name, lines)
        assert not out.exists() and not Path(f"{out}.partial").exists()
    out = tmp_path / "out-scan"
    assert main(["index", str(tmp_path / "scan"), "--out", str(out), "--encoder", f"visual:{colpali_checkpoint}",
                 "--no-progress", "--loader-workers", "0", "--device", "cpu"]) == 0
    with Searcher.open(out) as searcher:
        assert searcher.document("scan").text == "page 1 of scan"
