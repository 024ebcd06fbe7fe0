"""Page search with a dynamic-resolution model: benchmarks.make_visual_checkpoint's tiny seeded
ColQwen2 (Qwen2-VL: each page keeps its aspect ratio and gets its own patch grid, 8 px patches
merged 2x2, between 4 and 36 image vectors a page), made once for the module.

It covers the checkpoint itself (a small, reproducible visual Sentence Transformers save), espn's
visual encoder against the library's own encode on pages of different shapes (so of different
vector counts), that a page's image-vector count is the processor's `image_grid_thw` after
the merge, the grid that lays a page's vectors out, that espn finds and keeps each page's own
grid, and an index of such pages built, served, written, filtered, explained (each hit on its
own grid), restarted and compacted.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sentence_transformers import MultiVectorEncoder

from benchmarks.bench_visual import QUERIES, draw_page
from benchmarks.make_visual_checkpoint import write_colqwen2_checkpoint
from espn.cli import main
from espn.encoders.st_format import is_sentence_transformers_save, is_visual_save
from espn.encoders.visual import VisualEncoder
from espn.live.live_index import LiveIndex
from espn.pages.images import GRIDS_FILE, PageImages

from helpers import png, visual_encoder, visual_library
from server_fixtures import HTTP, running_server

#: (width, height): square, portrait, landscape and a larger page, each a different patch grid.
SIZES = [(64, 64), (60, 120), (150, 40), (200, 260)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_colqwen2_checkpoint(tmp_path_factory.mktemp("model") / "tiny-colqwen2")


@pytest.fixture(scope="module")
def library(checkpoint: Path) -> MultiVectorEncoder:
    return visual_library(checkpoint)


@pytest.fixture(scope="module")
def encoder(checkpoint: Path) -> VisualEncoder:
    return visual_encoder(checkpoint)


@pytest.fixture(scope="module")
def pages() -> list[Image.Image]:
    return [draw_page(number, size) for number, size in enumerate(SIZES)]


def test_the_checkpoint_is_a_small_reproducible_visual_save(checkpoint: Path, tmp_path: Path) -> None:
    assert is_sentence_transformers_save(checkpoint) and is_visual_save(checkpoint)
    assert sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file()) < 4 << 20
    again = write_colqwen2_checkpoint(tmp_path / "again")
    weights = sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*.safetensors"))
    assert weights  # the model's weights, at least
    for name in weights:
        assert (again / name).read_bytes() == (checkpoint / name).read_bytes(), name


def test_pages_of_each_shape_get_the_librarys_vectors(encoder: VisualEncoder, library: MultiVectorEncoder,
                                                       pages: list[Image.Image]) -> None:
    expected = library.encode_document(pages)
    counts = [len(e) for e in expected]
    assert len(set(counts)) == len(pages), counts  # dynamic resolution: each shape its own count
    found = encoder.encode_pages(pages)
    assert [len(bow) for _, bow in found.split()] == counts
    for (cls, bow), reference in zip(found.split(), expected):
        np.testing.assert_allclose(bow, reference.numpy(), atol=1e-5, rtol=0)
        mean = reference.numpy().sum(0)
        np.testing.assert_allclose(cls, mean / np.linalg.norm(mean), atol=1e-5)
    queries = encoder.encode_queries(QUERIES)
    for row, reference in enumerate(library.encode_query(QUERIES)):
        kept = queries.bow[row][queries.mask[row]]
        assert kept.shape == tuple(reference.shape)
        np.testing.assert_allclose(kept, reference.numpy(), atol=1e-5, rtol=0)


def test_a_pages_image_vectors_are_its_merged_patch_grid(library: MultiVectorEncoder,
                                                          pages: list[Image.Image]) -> None:
    processor = library[0].processor
    merge = processor.image_processor.merge_size
    features = library.preprocess(pages, prompt=None, task="document")
    grids = features["image_grid_thw"].tolist()
    assert grids[0] == [1, 8, 8]  # a 64 px square page: 8x8 patches of 8 px, 4x4 = 16 vectors
    assert [(h > w) for _, h, w in grids] == [(h > w) for w, h in SIZES]  # each page keeps its orientation
    assert all(t == 1 for t, _, _ in grids)  # an image is one frame
    image = (features["input_ids"] == processor.image_token_id) & features["attention_mask"].bool()
    merged = [(h // merge) * (w // merge) for _, h, w in grids]
    assert image.sum(1).tolist() == merged
    # The rest of a page's vectors are the visual prompt's, the same for every page, so the count
    # the library gives a page is its grid's plus a constant.
    counts = [len(e) for e in library.encode_document(pages)]
    prompt = {count - patches for count, patches in zip(counts, merged)}
    assert len(prompt) == 1 and 0 < prompt.pop() < min(counts)


def _grid(library: MultiVectorEncoder, page: Image.Image) -> tuple[int, int]:
    """(rows, columns) of a page's vectors, from the processor: `image_grid_thw` after the merge."""
    _, h, w = library.preprocess([page], prompt=None, task="document")["image_grid_thw"][0].tolist()
    merge = library[0].processor.image_processor.merge_size
    return h // merge, w // merge


def test_espn_finds_each_pages_own_grid(encoder: VisualEncoder, library: MultiVectorEncoder,
                                       pages: list[Image.Image]) -> None:
    assert encoder.page_grid() is None  # no one grid for every page of this model
    found = encoder.encode_pages(pages)
    assert found.grids is not None
    image_token = library[0].processor.image_token_id
    features = library.preprocess(pages, prompt=None, task="document")
    for page, (first, rows, columns, vectors), ids, mask, count in zip(
            pages, found.grids.tolist(), features["input_ids"], features["attention_mask"], found.counts.tolist()):
        assert (rows, columns) == _grid(library, page) and vectors == count
        kept = ids[mask.bool()]
        patches = (kept == image_token).nonzero().flatten().tolist()
        assert patches == list(range(first, first + rows * columns))  # the grid's cells, row-major


@pytest.fixture(scope="module")
def index(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pages of SIZES and two more, listed by a JSONL with a `shape` field, built by `espn index`."""
    corpus = tmp_path_factory.mktemp("pages")
    with open(corpus / "pages.jsonl", "w") as f:
        for number, (width, height) in enumerate([*SIZES, (90, 90), (120, 50)]):
            draw_page(number, (width, height)).save(corpus / f"p{number}.png")
            shape = "tall" if height > width else "wide" if width > height else "square"
            f.write(json.dumps({"_id": f"p{number}", "image": f"p{number}.png", "metadata": {"shape": shape}}) + "\n")
    out = tmp_path_factory.mktemp("idx") / "pages"
    assert main(["index", str(corpus / "pages.jsonl"), "--out", str(out), "--encoder", f"visual:{checkpoint}",
                 "--bow-dtype", "float16", "--chunk-size", "4", "--batch-size", "3", "--loader-workers", "0",
                 "--no-progress", "--device", "cpu"]) == 0
    return out


def test_the_build_keeps_each_pages_own_grid(index: Path, library: MultiVectorEncoder) -> None:
    images = PageImages.open(index, len(SIZES) + 2)
    assert images is not None and images.grids is not None
    expected = [_grid(library, draw_page(n, size)) for n, size in enumerate([*SIZES, (90, 90), (120, 50)])]
    assert [tuple(row[1:3]) for row in images.grids.tolist()] == expected
    assert len(set(expected)) == len(expected)  # every page a grid of its own


def test_pages_of_many_grids_served_written_filtered_explained_restarted_and_compacted(
        index: Path, encoder: VisualEncoder, library: MultiVectorEncoder, tmp_path: Path) -> None:
    """A ColQwen page index through a real server under `ulimit -n 1024`: a new page and a
    replaced one uploaded (each a grid no base page has), one deleted; a filtered, explained search
    places every match on the hit's own grid; the same after a restart and after compaction."""
    root = tmp_path / "served"
    shutil.copytree(index, root)
    page_of = {f"p{n}": draw_page(n, size) for n, size in enumerate([*SIZES, (90, 90), (120, 50)])}
    page_of |= {"new": draw_page(30, (180, 70)), "p1": draw_page(31, (50, 140))}
    grids = {doc_id: _grid(library, page) for doc_id, page in page_of.items()}
    first = int(encoder.encode_pages([page_of["p0"]]).grids[0][0])  # type: ignore[index]  # the prompt's length

    def search(**body: object) -> list[dict]:
        answer = HTTP.post(f"{server.base_url}/v1/search", json={"query": QUERIES[0], **body}, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()["results"]

    def check_explained() -> None:
        wide = search(k=10, filter={"shape": "wide"}, explain=True)
        assert {hit["id"] for hit in wide} == {"p2", "p5", "new"}
        for hit in [*wide, *search(k=10, explain=True)]:
            rows, columns = grids[hit["id"]]
            explanation = hit["explanation"]
            assert explanation["grid"] == [rows, columns], hit["id"]
            placed = [m for m in explanation["matches"] if "row" in m]
            assert placed, hit["id"]
            for match in placed:
                assert 0 <= match["row"] < rows and 0 <= match["column"] < columns
                assert match["vector"] == first + match["row"] * columns + match["column"]
            assert abs(sum(m["contribution"] for m in explanation["matches"]) - hit["bow_score"]) < 1e-3

    def upload(doc_id: str, metadata: dict) -> int:
        body = {"image": base64.b64encode(png(page_of[doc_id])).decode("ascii"), "metadata": metadata}
        return HTTP.put(f"{server.base_url}/v1/documents/{doc_id}", json=body, timeout=120).status_code

    with running_server(root, tmp_path, name="colqwen", fd_limit=1024) as server:
        assert upload("new", {"shape": "wide"}) == 201 and upload("p1", {"shape": "tall"}) == 200
        assert HTTP.delete(f"{server.base_url}/v1/documents/p3", timeout=60).status_code == 200
        check_explained()
    with running_server(root, tmp_path, "--no-warmup", name="colqwen-again", fd_limit=1024) as server:
        check_explained()
        assert HTTP.get(f"{server.base_url}/v1/documents/p3", timeout=60).status_code == 404
    writer = LiveIndex(root, encoder=encoder)
    try:
        writer.compact()
    finally:
        writer.close()
    with running_server(root, tmp_path, "--no-warmup", name="colqwen-compacted", fd_limit=1024) as server:
        check_explained()
