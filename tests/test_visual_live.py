"""Page images kept with a visual index, explanations as patches of the page, and live page writes.

One tiny seeded ColPali checkpoint (benchmarks.make_visual_checkpoint: 64 px pages cut into an
8 x 8 grid of patches, 81 vectors a page) and one index of 8 pages built by `espn index` from a
JSONL with metadata, made once for the module; the live tests write to a copy of it.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from PIL import Image

from benchmarks.bench_visual import draw_page
from espn import Searcher
from espn.cli import OWN_LOGGERS, main
from espn.encoders.visual import VisualEncoder
from espn.errors import ConflictError, DocumentNotFoundError, InvalidParameterError
from espn.first_stage.build import DEFAULT_FIRST_STAGE, PAGE_FIRST_STAGE
from espn.generation.format import read_current
from espn.live.checks import NewDocument
from espn.live.commit import GroupCommit
from espn.live.compaction import Plan, run_compaction
from espn.live.live_index import LiveIndex
from espn.live.snapshot import restore, snapshot
from espn.live.writer import IndexWriter
from espn.pages.images import (GRIDS_FILE, IMAGE_OFFSETS_FILE, IMAGES_FILE, MAX_STORED_SIDE, PageImages,
                              encode_page_image, media_type, thumbnail)
from espn.live.encoding import decode_page_bytes

from helpers import png, visual_encoder
from server_fixtures import HTTP, running_server

PAGES = 8
QUERY = "red square in the corner"


@pytest.fixture(scope="module")
def encoder(colpali_checkpoint: Path) -> VisualEncoder:
    return visual_encoder(colpali_checkpoint)


def espn(*argv: str) -> int:
    """`espn ARGV...` in this process, with no ESPN_* settings, the process's logging left as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in OWN_LOGGERS}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("ESPN_")})
        status = main(list(argv))
    root.handlers[:], root.level = handlers, level
    for name, value in levels.items():
        logging.getLogger(name).setLevel(value)
    return status


def espn_index(corpus: Path, out: Path, colpali_checkpoint: Path, *extra: str) -> int:
    """`espn index CORPUS --out OUT` with the tiny checkpoint."""
    return espn("index", str(corpus), "--out", str(out), "--encoder", f"visual:{colpali_checkpoint}", "--bow-dtype",
                "float16", "--chunk-size", "4", "--batch-size", "4", "--loader-workers", "0", "--no-progress",
                "--device", "cpu", *extra)


@pytest.fixture(scope="module")
def index(colpali_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 PNG pages listed by a JSONL with a `lang` field, built by `espn index`."""
    corpus = tmp_path_factory.mktemp("pages")
    with open(corpus / "pages.jsonl", "w") as f:
        for number in range(PAGES):
            draw_page(number).save(corpus / f"p{number}.png")
            f.write(json.dumps({"_id": f"p{number}", "image": f"p{number}.png",
                                "metadata": {"lang": "en" if number % 2 else "fr"}}) + "\n")
    out = tmp_path_factory.mktemp("idx") / "pages"
    assert espn_index(corpus / "pages.jsonl", out, colpali_checkpoint) == 0
    return out


@pytest.fixture(scope="module")
def live(index: Path, tmp_path_factory: pytest.TempPathFactory, encoder: VisualEncoder) -> Path:
    """A copy of the index after live writes: page `new` added, p1 replaced, p2 deleted."""
    root = tmp_path_factory.mktemp("live") / "pages"
    shutil.copytree(index, root)
    writer = LiveIndex(root, encoder=encoder)
    try:
        writer.upsert([NewDocument("new", image=png(draw_page(20)), metadata={"lang": "de"}),
                       NewDocument("p1", image=png(draw_page(21, (90, 300))), title="replaced")])
        writer.delete(["p2"])
    finally:
        writer.close()
    return root


def stored(image: Image.Image) -> bytes:
    """The bytes an index keeps for a page it read as `image`."""
    return encode_page_image(image.convert("RGB"))


def test_stored_images_are_bounded_jpeg_and_thumbnails_are_smaller() -> None:
    data = encode_page_image(Image.new("RGB", (3200, 1000), (250, 250, 250)))
    assert media_type(data) == "image/jpeg"
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == (MAX_STORED_SIDE, 500)
    small = thumbnail(data, 200)
    with Image.open(io.BytesIO(small)) as image:
        assert max(image.size) == 200
    assert thumbnail(small, 400) == small  # never scaled up
    with pytest.raises(InvalidParameterError, match="thumbnail side"):
        thumbnail(data, 4)


def test_the_build_keeps_each_pages_image_listed_in_the_manifest(index: Path) -> None:
    manifest = json.loads((index / "manifest.json").read_text())
    assert {IMAGES_FILE, IMAGE_OFFSETS_FILE} <= set(manifest["files"])
    # pages start with their own first-stage default (docs/benchmarks/first-stage.md, "Pages")
    assert manifest["first_stage"]["kind"] == "centroids"
    assert manifest["first_stage"]["probe"] == PAGE_FIRST_STAGE.probe != DEFAULT_FIRST_STAGE.probe
    with Searcher.open(index, with_encoder=False) as searcher:
        assert searcher.is_page_index
        for number in range(PAGES):
            data, kind = searcher.page_image(f"p{number}")
            assert kind == "image/jpeg" and data == stored(draw_page(number))
        small, kind = searcher.page_image("p3", max_side=32)
        assert kind == "image/jpeg" and max(Image.open(io.BytesIO(small)).size) <= 32
        with pytest.raises(DocumentNotFoundError):
            searcher.page_image("nope")


def test_explain_gives_each_query_token_its_patch_and_the_exact_maxsim_term(
        index: Path, encoder: VisualEncoder) -> None:
    grid = encoder.page_grid()
    assert grid is not None and (grid.rows, grid.columns) == (8, 8) and grid.vectors == 81
    with Searcher.open(index) as searcher:
        result = searcher.search([QUERY, "blue circles chart"], k=3, explain=True)
        q = searcher.encode([QUERY, "blue circles chart"])
    for row, hits in enumerate(result):
        assert hits.hits
        for hit in hits.hits:
            explanation = hit.explanation
            assert explanation is not None and explanation.grid == (8, 8)
            page = encoder.encode_pages([draw_page(int(hit.doc_id[1:]))]).bow  # [81, 128] fp32
            query = q.bow[row][q.mask[row]]
            terms = (query @ page.T).max(axis=1)
            assert len(explanation.matches) == len(query)
            np.testing.assert_allclose([m.similarity for m in explanation.matches], terms, atol=2e-3)
            assert abs(sum(m.contribution for m in explanation.matches) - hit.bow_score) < 1e-4
            patches = 0
            for match, vector_row in zip(explanation.matches, query):
                assert 0 <= match.vector < 81
                assert abs(float(page[match.vector] @ vector_row) - match.similarity) < 2e-3
                if match.row is None:
                    assert match.column is None and not grid.first <= match.vector < grid.first + 64
                else:
                    patches += 1
                    assert 0 <= match.row < 8 and 0 <= match.column < 8  # type: ignore[operator]
                    assert match.vector == grid.first + 8 * match.row + match.column  # type: ignore[operator]
            assert patches > 0
        texts = [m for m in hits.hits[0].explanation.matches if m.kind == "text"]  # type: ignore[union-attr]
        query_text = [QUERY, "blue circles chart"][row]
        assert texts and all(query_text[m.query_start:m.query_end] == m.token for m in texts)


def test_each_pages_grid_is_kept_and_an_index_without_grids_explains_with_the_models_one(
        index: Path, encoder: VisualEncoder, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    grid = encoder.page_grid()
    assert grid is not None
    manifest = json.loads((index / "manifest.json").read_text())
    assert GRIDS_FILE in manifest["files"]
    images = PageImages.open(index, PAGES)
    assert images is not None and images.grids is not None
    assert images.grids.tolist() == [[grid.first, 8, 8, 81]] * PAGES
    # an index written before grids were kept: the model's one grid
    legacy = tmp_path / "legacy"
    shutil.copytree(index, legacy)
    (legacy / GRIDS_FILE).unlink()
    del manifest["files"][GRIDS_FILE]
    (legacy / "manifest.json").write_text(json.dumps(manifest))
    with Searcher.open(legacy) as searcher:
        hits = searcher.search([QUERY], k=3, explain=True)[0].hits
    assert hits and all(hit.explanation is not None and hit.explanation.grid == (8, 8) for hit in hits)
    # grids that do not fit the pages are left out, with a warning; the images stay
    np.save(legacy / GRIDS_FILE, np.zeros((PAGES - 1, 4), np.int32))
    with caplog.at_level(logging.WARNING, logger="espn.pages.images"):
        reopened = PageImages.open(legacy, PAGES)
    assert reopened is not None and reopened.grids is None and reopened.of(0)
    assert "its pages have no grid" in caplog.text


def test_live_pages_are_added_replaced_and_deleted_with_their_images(live: Path) -> None:
    generation = read_current(live)
    needed = {f.path for f in generation.needed_files()}
    assert any(path.endswith(f"/{IMAGES_FILE}") and path.startswith("live/seg-") for path in needed)
    assert IMAGES_FILE in needed  # the base's, which snapshots and replicas copy too
    with Searcher.open(live) as searcher:
        assert searcher.page_image("new")[0] == stored(draw_page(20))
        assert searcher.page_image("p1")[0] == stored(draw_page(21, (90, 300)))
        assert searcher.page_image("p0")[0] == stored(draw_page(0))
        assert searcher.document("new").metadata == {"source": "new", "page": 1, "lang": "de"}
        assert searcher.document("p1").title == "replaced"
        for call in (searcher.page_image, searcher.document):
            with pytest.raises(DocumentNotFoundError):
                call("p2")
        found = {hit.doc_id for hit in searcher.search([QUERY], k=PAGES + 2)[0].hits}
        assert found == {f"p{n}" for n in range(PAGES) if n != 2} | {"new"}
        assert [h.doc_id for h in searcher.search([QUERY], k=5, filter={"lang": "de"})[0].hits] == ["new"]
        explained = searcher.search([QUERY], k=PAGES, explain=True)[0].hits
        assert all(hit.explanation is not None and hit.explanation.grid == (8, 8) for hit in explained)


def test_a_snapshot_and_its_restore_carry_the_page_images(live: Path, tmp_path: Path) -> None:
    snapshot(live, tmp_path / "snap")
    restore(tmp_path / "snap", tmp_path / "restored")
    with Searcher.open(tmp_path / "restored", with_encoder=False) as searcher:
        assert searcher.page_image("new")[0] == stored(draw_page(20))
        assert searcher.page_image("p0")[0] == stored(draw_page(0))


def test_compaction_keeps_every_pages_image_and_a_reopened_index_serves_them(
        live: Path, encoder: VisualEncoder, tmp_path: Path) -> None:
    root = tmp_path / "compacted"
    shutil.copytree(live, root)
    writer = LiveIndex(root, encoder=encoder)
    try:
        writer.compact()
    finally:
        writer.close()
    generation = read_current(root)
    assert not generation.segments and IMAGES_FILE in generation.base_files
    expected = {f"p{n}": stored(draw_page(n)) for n in range(PAGES) if n not in (1, 2)}
    expected |= {"new": stored(draw_page(20)), "p1": stored(draw_page(21, (90, 300)))}
    with Searcher.open(root, with_encoder=False) as searcher:
        assert searcher.num_documents == PAGES
        assert {doc_id: searcher.page_image(doc_id)[0] for doc_id in expected} == expected
        with pytest.raises(DocumentNotFoundError):
            searcher.page_image("p2")


def test_a_merge_of_deltas_keeps_their_images_and_leaves_a_deleted_page_none(
        live: Path, encoder: VisualEncoder, tmp_path: Path) -> None:
    root = tmp_path / "merged"
    shutil.copytree(live, root)
    writer = LiveIndex(root, encoder=encoder)
    try:
        writer.upsert([NewDocument("late", image=png(draw_page(22)))])
        writer.delete(["new"])  # a page of the first delta: a hole in the merged segment
        deltas = tuple(info.name for info in read_current(root).segments)
        assert len(deltas) == 2
        run_compaction(writer, Plan("merge", deltas))
    finally:
        writer.close()
    generation = read_current(root)
    merged = generation.segments[0]
    assert len(generation.segments) == 1 and IMAGES_FILE in merged.files
    images = PageImages.open(root / "live" / merged.name, merged.documents)
    assert images is not None and images.of(0) == b"" and images.of(1)  # "new" (deleted) has no bytes left
    assert images.grids is not None and not images.grids[0].any()  # nor a grid
    assert images.grids[1].tolist() == images.grids[2].tolist() and images.grids[1][1:].tolist() == [8, 8, 81]
    with Searcher.open(root, with_encoder=False) as searcher:
        assert searcher.page_image("late")[0] == stored(draw_page(22))
        assert searcher.page_image("p1")[0] == stored(draw_page(21, (90, 300)))
        with pytest.raises(DocumentNotFoundError):
            searcher.page_image("new")


def test_page_writes_are_checked_before_anything_is_written(live: Path, encoder: VisualEncoder,
                                                            tmp_path: Path) -> None:
    root = tmp_path / "refusals"
    shutil.copytree(live, root)
    before = read_current(root).number
    writer = LiveIndex(root, encoder=encoder)
    try:
        cases = [(NewDocument("t", "a text passage"), "give the page as an image"),  # a ConflictError: a 409
                 (NewDocument("b", image=b"GIF89a not a page"), "not a PNG, JPEG or WebP"),
                 (NewDocument("c", image=png(draw_page(1))[:60]), "unreadable PNG image")]
        for document, message in cases:
            with pytest.raises(InvalidParameterError, match=message) as caught:
                writer.upsert([document])
            assert "\n" not in str(caught.value)
    finally:
        writer.close()
    assert read_current(root).number == before
    text_writer = IndexWriter(root, encoder=SimpleNamespace(reads_pages=False))  # type: ignore[arg-type]
    with pytest.raises(ConflictError, match="an image, but this index holds text"):
        text_writer.encode([NewDocument("i", image=png(draw_page(1)))])
    text_writer.close()
    with pytest.raises(Exception, match="refused"):
        decode_page_bytes(png(Image.new("RGB", (20_000, 2), (0, 0, 0))), "huge")


def test_a_page_that_does_not_decode_fails_only_its_own_write_in_a_group(live: Path, encoder: VisualEncoder,
                                                                          tmp_path: Path) -> None:
    root = tmp_path / "group"
    shutil.copytree(live, root)
    committer = GroupCommit(LiveIndex(root, encoder=encoder), nice=0)
    try:
        committer.index.warmup()
        # Another writer holds the lock: the first write waits to publish, the second waits encoded,
        # and the next two queue behind them as one group.
        with IndexWriter(root).locked():
            first = []
            for n in range(2):
                first.append(committer.submit([NewDocument(f"w{n}", image=png(draw_page(40 + n)))]))
                time.sleep(0.3)
            futures = [committer.submit([NewDocument("g0", image=png(draw_page(30)))]),
                       committer.submit([NewDocument("bad", image=png(draw_page(1))[:60])]),
                       committer.submit([NewDocument("g1", image=png(draw_page(31)))])]
        assert all(f.result(timeout=60).created for f in first)
        with pytest.raises(InvalidParameterError, match="unreadable PNG image"):
            futures[1].result(timeout=60)
        assert [bool(f.result(timeout=60).created) for f in (futures[0], futures[2])] == [True, True]
    finally:
        committer.close()
        committer.index.close()
    with Searcher.open(root, with_encoder=False) as searcher:
        assert searcher.page_image("g1")[0] == stored(draw_page(31))
        with pytest.raises(DocumentNotFoundError):
            searcher.document("bad")


def test_pages_over_http_uploaded_searched_filtered_explained_fetched_and_kept_across_a_restart(
        index: Path, tmp_path: Path) -> None:
    root = tmp_path / "served"
    shutil.copytree(index, root)

    def upload(doc_id: str, image: Image.Image, **fields: object) -> httpx.Response:
        body = {"image": base64.b64encode(png(image)).decode("ascii"), **fields}
        return HTTP.put(f"{server.base_url}/v1/documents/{doc_id}", json=body, timeout=120)

    def search(**body: object) -> list[dict]:
        answer = HTTP.post(f"{server.base_url}/v1/search", json={"query": QUERY, **body}, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()["results"]

    with running_server(root, tmp_path, name="pages") as server:
        assert "write path warmed" in server.log()  # with a blank page: a passage is refused by a page index
        assert upload("upload", draw_page(50), metadata={"lang": "de"}).status_code == 201
        replaced = upload("p1", draw_page(51, (90, 300)), title="replaced")
        assert replaced.status_code == 200 and replaced.json()["replaced"] == ["p1"]
        assert HTTP.delete(f"{server.base_url}/v1/documents/p2", timeout=60).status_code == 200
        text = HTTP.put(f"{server.base_url}/v1/documents/t", json={"text": "a passage"}, timeout=60)
        assert text.status_code == 409 and "give the page as an image" in text.json()["message"]
        broken = HTTP.put(f"{server.base_url}/v1/documents/b", json={"image": "not base64!"}, timeout=60)
        assert broken.status_code == 422
        assert {hit["id"] for hit in search(k=20)} == {f"p{n}" for n in range(PAGES) if n != 2} | {"upload"}
        assert [hit["id"] for hit in search(k=5, filter={"lang": "de"})] == ["upload"]
        for hit in search(k=3, explain=True):
            explanation = hit["explanation"]
            assert explanation["grid"] == [8, 8]
            cells = [(m["row"], m["column"]) for m in explanation["matches"] if "row" in m]
            assert cells and all(0 <= r < 8 and 0 <= c < 8 for r, c in cells)
        image = HTTP.get(f"{server.base_url}/v1/documents/upload", params={"image": "true"}, timeout=60)
        assert image.status_code == 200 and image.headers["content-type"] == "image/jpeg"
        assert image.content == stored(draw_page(50))
        small = HTTP.get(f"{server.base_url}/v1/documents/upload", params={"image": "true", "max_side": 16})
        assert small.status_code == 200 and max(Image.open(io.BytesIO(small.content)).size) <= 16
        assert HTTP.get(f"{server.base_url}/v1/documents/p2", params={"image": "true"}).status_code == 404
    with running_server(root, tmp_path, "--no-warmup", name="pages-again") as server:
        again = HTTP.get(f"{server.base_url}/v1/documents/upload", params={"image": "true"}, timeout=60)
        assert again.status_code == 200 and again.content == stored(draw_page(50))
        document = HTTP.get(f"{server.base_url}/v1/documents/upload", timeout=60).json()
        assert document["metadata"] == {"source": "upload", "page": 1, "lang": "de"}
        assert [hit["id"] for hit in search(k=5, filter={"lang": "de"})] == ["upload"]
        assert HTTP.get(f"{server.base_url}/v1/documents/p2", timeout=60).status_code == 404


def test_pdfs_rendered_indexed_served_written_filtered_explained_and_restarted(
        colpali_checkpoint: Path, tmp_path: Path) -> None:
    """The issue's end-to-end run from PDFs: two PDFs (3 and 2 pages) rendered by PDFium and
    indexed by `espn index`, served, one page replaced and one deleted over HTTP, searched with
    a filter on the `source` the build adds, explained, and the same again after a restart."""
    corpus = tmp_path / "pdfs"
    (corpus / "reports").mkdir(parents=True)
    for name, numbers in (("reports/a.pdf", (0, 1, 2)), ("b.pdf", (3, 4))):
        pages = [draw_page(n) for n in numbers]
        pages[0].save(corpus / name, format="PDF", save_all=True, append_images=pages[1:], resolution=72)
    root = tmp_path / "index"
    assert espn_index(corpus, root, colpali_checkpoint, "--dpi", "72") == 0
    ids = {"reports/a.pdf#1", "reports/a.pdf#2", "reports/a.pdf#3", "b.pdf#1", "b.pdf#2"}

    def url(doc_id: str) -> str:
        return f"{server.base_url}/v1/documents/{quote(doc_id, safe='')}"

    def search(**body: object) -> list[dict]:
        answer = HTTP.post(f"{server.base_url}/v1/search", json={"query": QUERY, **body}, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()["results"]

    with running_server(root, tmp_path, name="pdfs") as server:
        assert {hit["id"] for hit in search(k=10)} == ids
        document = HTTP.get(url("reports/a.pdf#2"), timeout=60).json()
        assert document["metadata"] == {"source": "reports/a.pdf", "page": 2}
        rendered = HTTP.get(url("b.pdf#2"), params={"image": "true"}, timeout=60)
        assert rendered.status_code == 200 and rendered.headers["content-type"] == "image/jpeg"
        body = {"image": base64.b64encode(png(draw_page(60))).decode("ascii"),
                "metadata": {"source": "reports/a.pdf", "page": 2}}
        replaced = HTTP.put(url("reports/a.pdf#2"), json=body, timeout=120)
        assert replaced.status_code == 200 and replaced.json()["replaced"] == ["reports/a.pdf#2"]
        assert HTTP.delete(url("b.pdf#1"), timeout=60).status_code == 200
        in_a = search(k=10, filter={"source": "reports/a.pdf"}, explain=True)
        assert {hit["id"] for hit in in_a} == {"reports/a.pdf#1", "reports/a.pdf#2", "reports/a.pdf#3"}
        for hit in in_a:
            assert hit["explanation"]["grid"] == [8, 8]
            assert any("row" in match for match in hit["explanation"]["matches"])
        served = HTTP.get(url("reports/a.pdf#2"), params={"image": "true"}, timeout=60).content
        assert served == stored(draw_page(60))
    with running_server(root, tmp_path, "--no-warmup", name="pdfs-again") as server:
        assert {hit["id"] for hit in search(k=10)} == ids - {"b.pdf#1"}
        assert HTTP.get(url("b.pdf#1"), timeout=60).status_code == 404
        assert HTTP.get(url("reports/a.pdf#2"), params={"image": "true"}, timeout=60).content == served
        assert [hit["id"] for hit in search(k=10, filter={"source": "b.pdf"})] == ["b.pdf#2"]


def test_espn_add_upserts_a_folder_of_pages_and_refuses_a_text_corpus(index: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`espn add` on an index of pages takes a page corpus as the build does: new pages are
    found, a page whose id exists is replaced, and their images are kept; text is one line."""
    root = tmp_path / "index"
    shutil.copytree(index, root)
    folder = tmp_path / "more"
    folder.mkdir()
    with open(folder / "pages.jsonl", "w") as f:
        for doc_id, number in (("p3", 70), ("extra", 71)):
            draw_page(number).save(folder / f"{doc_id}.png")
            f.write(json.dumps({"_id": doc_id, "image": f"{doc_id}.png", "metadata": {"lang": "it"}}) + "\n")
    assert espn("add", str(root), str(folder / "pages.jsonl"), "--loader-workers", "0", "--no-progress") == 0
    assert "1 added, 1 replaced" in capsys.readouterr().out
    with Searcher.open(root) as searcher:
        everything = searcher.search([QUERY], k=20)[0]
        assert {hit.doc_id for hit in everything.hits} == {f"p{n}" for n in range(PAGES)} | {"extra"}
        ranked = searcher.search([QUERY], k=5, filter={"lang": "it"})[0]
        assert {hit.doc_id for hit in ranked.hits} == {"p3", "extra"}
        assert searcher.page_image("extra")[0] == stored(draw_page(71))
    text = tmp_path / "corpus.jsonl"
    text.write_text(json.dumps({"_id": "t", "text": "a passage"}) + "\n")
    assert espn("add", str(root), str(text), "--no-progress") != 0
    assert "the index holds pages" in capsys.readouterr().err
