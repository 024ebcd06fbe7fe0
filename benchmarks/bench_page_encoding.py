"""Page encoding on a device against the CPU's float32: pages a second, and what autocast costs.

    python -m benchmarks.bench_page_encoding --device cuda                  # the tiny ColPali and ColQwen2
    python -m benchmarks.bench_page_encoding --device cuda --model DIR      # a real checkpoint on disk

On a GPU the visual encoder runs the model under autocast in bfloat16 (float16 where the card
lacks it: `espn.encoders.visual`); on a CPU in float32, identical to the library's encode, which
the tests check. This is the one place that says what the GPU path gives: the same pages are
encoded on the CPU (the reference) and on `--device`, in batches, and it reports pages a second
on each (the median of `--rounds` passes after one warm-up batch), the largest absolute
difference of a vector, the largest relative difference of a (query, page) MaxSim score and how
many queries keep the CPU's top page, and whether every page kept the same patch grid
(`espn.pages.grids`). The pages are drawn in several shapes, so a dynamic-resolution model
(ColQwen) sees several grids in one batch.

Without a model it writes benchmarks.make_visual_checkpoint's tiny ColPali and ColQwen2 to a
temporary folder and measures both: their speed says nothing about a real model, their
fidelity says what autocast does to the same code path. `--device cpu` runs the comparison
against itself (every difference 0), which is what CI checks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from benchmarks.bench_visual import QUERIES, draw_page
from benchmarks.common import machine, write_results

#: Page shapes (width, height) drawn in turn: square, portrait, landscape, a larger portrait.
SHAPES = ((64, 64), (60, 120), (150, 40), (200, 260))


def _encode(encoder: Any, pages: Sequence[Any], batch: int) -> tuple[list[np.ndarray], np.ndarray, float]:
    """Per page its vectors (float32), the pages' grids [n, 4], and the seconds the pass took."""
    vectors: list[np.ndarray] = []
    grids = []
    started = time.perf_counter()
    for start in range(0, len(pages), batch):
        encoded = encoder.encode_pages(pages[start : start + batch])
        vectors += [bow.astype(np.float32) for _, bow in encoded.split()]
        grids.append(encoded.grids if encoded.grids is not None else np.zeros((len(encoded), 4), np.int32))
    if encoder.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    return vectors, np.concatenate(grids), time.perf_counter() - started


def _scores(queries: Any, pages: list[np.ndarray]) -> np.ndarray:
    """[queries, pages] MaxSim sums over each query's kept vectors."""
    out = np.zeros((len(queries.bow), len(pages)), dtype=np.float64)
    for row in range(len(queries.bow)):
        q = queries.bow[row][queries.mask[row]].astype(np.float32)
        for column, page in enumerate(pages):
            out[row, column] = float((q @ page.T).max(axis=1).sum()) if len(page) else 0.0
    return out


def measure(model: Path, device: str, pages: int = 32, batch: int = 8, rounds: int = 3) -> dict[str, Any]:
    """The comparison above for one checkpoint directory."""
    from espn.encoders import encoder_from_spec

    drawn = [draw_page(n, SHAPES[n % len(SHAPES)]) for n in range(pages)]
    cpu = encoder_from_spec(f"visual:{model}", device="cpu")
    target = cpu if device == "cpu" else encoder_from_spec(f"visual:{model}", device=device)
    reference, reference_grids, cpu_s = _encode(cpu, drawn, batch)
    _encode(target, drawn[:batch], batch)  # warm-up: kernels, allocator, autocast caches
    passes = [_encode(target, drawn, batch) for _ in range(max(1, rounds))]
    found, grids, _ = passes[-1]
    if [len(v) for v in found] != [len(v) for v in reference]:
        raise RuntimeError(f"{model}: the vector counts on {device} differ from the CPU's")
    expected, got = _scores(cpu.encode_queries(QUERIES), reference), _scores(target.encode_queries(QUERIES), found)
    autocast = str(getattr(target, "autocast_dtype", "")).replace("torch.", "") if device.startswith("cuda") else None
    return {
        "model": str(model), "device": device, "autocast": autocast, "pages": pages, "batch": batch,
        "vectors_per_page": float(np.mean([len(v) for v in reference])),
        "cpu_pages_per_s": pages / cpu_s,
        "device_pages_per_s": pages / statistics.median(seconds for _, _, seconds in passes),
        "max_abs_vector_error": max(float(np.abs(a - b).max()) for a, b in zip(found, reference) if len(a)),
        "max_relative_maxsim_error": float(np.max(np.abs(got - expected) / np.maximum(np.abs(expected), 1e-9))),
        "top1_kept": int(np.sum(got.argmax(1) == expected.argmax(1))), "queries": len(QUERIES),
        "grids_equal": bool(np.array_equal(grids, reference_grids)),
        "distinct_grids": len({tuple(row[1:3]) for row in reference_grids.tolist()}),
    }


def tiny_models(folder: Path) -> list[Path]:
    """benchmarks.make_visual_checkpoint's two families, written into `folder`."""
    from benchmarks.make_visual_checkpoint import write_checkpoint, write_colqwen2_checkpoint

    return [write_checkpoint(folder / "tiny-colpali"), write_colqwen2_checkpoint(folder / "tiny-colqwen2")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="where to encode against the CPU (default cuda)")
    parser.add_argument("--model", type=Path, action="append", help="a visual checkpoint (default: the two tiny ones)")
    parser.add_argument("--pages", type=int, default=32, help="pages drawn (default 32)")
    parser.add_argument("--batch", type=int, default=8, help="pages a batch (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes on the device (default 3)")
    parser.add_argument("--name", default="page_encoding", help="results name (benchmarks/results/NAME.json)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("bench_page_encoding: CUDA is absent (torch sees no CUDA device); nothing measured", file=sys.stderr)
            return 1
    with tempfile.TemporaryDirectory() as scratch:
        models = args.model or tiny_models(Path(scratch))
        rows = [measure(model, args.device, args.pages, args.batch, args.rounds) for model in models]
    print("| model | device (autocast) | vectors/page | CPU pages/s | device pages/s | max abs vector error "
          "| max relative MaxSim error | top page kept | grids equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {Path(row['model']).name} | {row['device']} ({row['autocast'] or 'float32'}) | "
              f"{row['vectors_per_page']:.1f} | {row['cpu_pages_per_s']:.1f} | {row['device_pages_per_s']:.1f} | "
              f"{row['max_abs_vector_error']:.2e} | {row['max_relative_maxsim_error']:.2e} | "
              f"{row['top1_kept']}/{row['queries']} | {row['grids_equal']} |")
    write_results(args.name, {"machine": machine(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
