"""Page indexes against the library: bytes per page at each record kind, MaxSim fidelity, encode time.

    python -m benchmarks.make_visual_checkpoint /tmp/tiny-colpali
    python -m benchmarks.bench_visual --model /tmp/tiny-colpali --pages 48

Draws `pages` distinct page images (PIL shapes and text), builds one index per record dtype
with `espn index` (float16; int8 unpooled and pooled by 2 and 3 at index time), and prints per dtype: vectors per page,
embeddings.bin bytes per page, the largest relative error of the index's exhaustive MaxSim
against `MultiVectorEncoder.similarity` over every (query, page) pair, and how often the
index's top 1 is the library's. Encode time per page is the library-exact CPU path
(`VisualEncoder.encode_pages`, batches of 8), without the model load.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw
from sentence_transformers import MultiVectorEncoder

from espn import Searcher
from espn.encoders import encoder_from_spec
from espn.pages.corpus import iter_pages
from indexing.build import BuildConfig, build_index

QUERIES = ["red square in the corner", "blue circles chart", "total revenue table", "green lines", "page seven",
           "annual results summary", "a map with a legend", "black text title"]


def draw_page(number: int, size: tuple[int, int] = (120, 160)) -> Image.Image:
    """A page with its own shapes, colours and text (tests/test_visual.py draws the same)."""
    rng = np.random.default_rng(number)
    image = Image.new("RGB", size, tuple(int(v) for v in rng.integers(180, 256, 3)))
    draw = ImageDraw.Draw(image)
    for _ in range(3 + number % 4):
        x, y = (int(v) for v in rng.integers(0, min(size) - 30, 2))
        colour = tuple(int(v) for v in rng.integers(0, 200, 3))
        if number % 2:
            draw.ellipse([x, y, x + 25, y + 25], fill=colour)
        else:
            draw.rectangle([x, y, x + 30, y + 15 + number % 20], fill=colour)
    draw.text((6, size[1] - 20), f"page {number}", fill=(0, 0, 0))
    return image


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a ColPali-class checkpoint directory")
    parser.add_argument("--pages", type=int, default=48, help="pages to draw (default 48)")
    parser.add_argument("--work", type=Path, default=None, help="where to build (default: a temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        corpus = work / "pages"
        corpus.mkdir(parents=True, exist_ok=True)
        for number in range(args.pages):
            draw_page(number).save(corpus / f"p{number:05d}.png")
        pages = list(iter_pages(corpus))
        library = MultiVectorEncoder(str(args.model), device="cpu", local_files_only=True)
        reference = library.similarity(library.encode_query(QUERIES),
                                       library.encode_document([p.image for p in pages])).numpy()
        position = {page.id: i for i, page in enumerate(pages)}
        encoder = encoder_from_spec(f"colbert:{args.model}", device="cpu")
        started = time.perf_counter()
        for start in range(0, len(pages), 8):
            encoder.encode_pages([p.image for p in pages[start : start + 8]])  # type: ignore[attr-defined]
        per_page_ms = 1000 * (time.perf_counter() - started) / len(pages)
        print(f"{len(pages)} pages, {len(QUERIES)} queries; encode {per_page_ms:.1f} ms/page on CPU (batches of 8)")
        print("| records | pool factor | vectors/page | embeddings.bin bytes/page | max relative MaxSim error "
              "| top-1 = library's |")
        print("|---|---|---|---|---|---|")
        for dtype, pool in (("float16", 1), ("int8", 1), ("int8", 2), ("int8", 3)):
            out = work / f"index-{dtype}-{pool}"
            build_index(BuildConfig(corpus=corpus, out=out, encoder=f"colbert:{args.model}", bow_dtype=dtype,
                                    pool_factor=pool, progress=False, loader_workers=0, device="cpu", force=True))
            manifest = json.loads((out / "manifest.json").read_text())
            with Searcher.open(out) as searcher:
                hits = searcher.search_maxsim_exhaustive(searcher.encode(QUERIES), k=len(pages))
            errors, agree = [], 0
            for row, ranked in enumerate(hits):
                for hit in ranked:
                    expected = reference[row, position[hit.doc_id]]
                    errors.append(abs(hit.score - expected) / abs(expected))
                agree += ranked[0].doc_id == pages[int(np.argmax(reference[row]))].id
            vectors = manifest["counts"]["bow_vectors"] / len(pages)
            size = (out / "embeddings.bin").stat().st_size / len(pages)
            print(f"| {dtype} | {pool} | {vectors:.0f} | {size:,.0f} | {max(errors):.2e} | {agree}/{len(QUERIES)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
