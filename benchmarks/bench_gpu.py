"""The GPU run: the memory-limit table, the reader comparison and the hit-rate table, on CUDA with kvikio.

    python -m benchmarks.bench_gpu --index /data/synth2m --scifact .espn/scifact-index
    python -m benchmarks.bench_gpu --index /tmp/espn-synth --quick

One command for the first CUDA machine with kvikio (`pip install -e ".[kvikio,bench]"`
with a CUDA build of torch). It reuses the CPU studies, with the kvikio reader added,
and writes the same JSON and PNG under other names (benchmarks/results/):

1. `gpu_memory_limits`: bench_memory under cgroup memory limits (as root), readers
   memory, mmap, posix and kvikio, each with and without prefetch (memory only at 100%);
2. `gpu_readers`: the same readers with and without prefetch, no memory limit: kvikio
   vs posix vs memory on this GPU and SSD;
3. `gpu_prefetch`: bench_prefetch (hit rate against prefetch step) through the kvikio reader;
4. `gpu`: the machine, the GPU, and what the kvikio reader reported at open (engine
   "kvikio-gds" or "kvikio-compat", thread pool, GDS threshold, task size);
5. `gpu_page_encoding`: bench_page_encoding, the visual encoder on the GPU (autocast) against
   the CPU's float32 with the tiny ColPali and ColQwen2: pages a second and fidelity. It runs
   first, and needs CUDA only.

Every measured process opens its searcher on the GPU (`Searcher` picks CUDA when torch
sees it), so posix and memory are compared with MaxSim on the same device. Without CUDA it
prints one line saying so and exits with status 1, measuring nothing; without kvikio it
measures the page encoding only, then says kvikio is missing in one line (status 1). No GPU number in the docs comes from anywhere but this script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import set_omp_env

set_omp_env()  # before torch and faiss are imported: see benchmarks.common.OMP_ENV

from benchmarks.common import SCIFACT, SCIFACT_INDEX, machine, write_results

#: READER:PREFETCH for the two bench_memory runs.
GPU_CONFIGS = "memory:0,memory:1,mmap:0,posix:0,posix:1,kvikio:0,kvikio:1"
READER_CONFIGS = "memory:0,memory:1,posix:0,posix:1,kvikio:0,kvikio:1"


def cuda_absent() -> str | None:
    """Why nothing can be measured here (no CUDA device), or None."""
    import torch

    return None if torch.cuda.is_available() else "CUDA is absent (torch sees no CUDA device)"


def unavailable_reason() -> str | None:
    """Why the whole GPU run cannot happen here (CUDA or kvikio missing), or None."""
    absent = cuda_absent()
    if absent is not None:
        return absent
    from espn.store import KvikioReader

    reason = KvikioReader.unavailable_reason()
    return f"kvikio is absent: {reason}" if reason else None


def describe_gpu(index: Path) -> dict[str, Any]:
    """The GPU and what the kvikio reader configured, from opening it on the index."""
    import torch

    from espn import Searcher

    with Searcher.open(index, reader="kvikio", verify="none", with_encoder=False) as searcher:
        reader = searcher.reader.describe()
    return {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda, "kvikio_reader": reader}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--index", type=Path, required=True, help="large index; its queries at INDEX.queries.npz")
    p.add_argument("--scifact", type=Path, default=SCIFACT_INDEX, help="built SciFact index for the hit rate ('' to skip)")
    p.add_argument("--scifact-data", type=Path, default=SCIFACT)
    p.add_argument("--quick", action="store_true", help="the quick mode of every study")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--n", type=int, default=300, help="measured queries per configuration")
    p.add_argument("--params", default="{}", help="JSON search overrides for every study")
    args = p.parse_args(argv)

    absent = cuda_absent()
    if absent is not None:
        print(f"bench_gpu: {absent}; nothing measured (run it on a CUDA machine with "
              f'pip install "espn[kvikio]")', file=sys.stderr)
        return 1
    from benchmarks import bench_memory, bench_page_encoding, bench_prefetch

    print("## Page encoding: the visual encoder under autocast against the CPU's float32\n")
    status = bench_page_encoding.main(["--device", "cuda", "--name", "gpu_page_encoding"])
    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_gpu: {reason}; the reader studies need it (pip install \"espn[kvikio]\")", file=sys.stderr)
        return 1

    common = ["--index", str(args.index), "--params", args.params, "--repeats", str(args.repeats), "--n", str(args.n)]
    common += ["--quick"] if args.quick else []
    info = {"machine": machine(), "index": str(args.index), **describe_gpu(args.index)}
    print(f"GPU {info['gpu']}, kvikio reader: {info['kvikio_reader']}", file=sys.stderr)
    print("## Memory limits (GPU)\n")
    status |= bench_memory.main([*common, "--configs", GPU_CONFIGS, "--name", "gpu_memory_limits"])
    print("\n## Readers, with and without prefetch (GPU, no memory limit)\n")
    status |= bench_memory.main([*common, "--configs", READER_CONFIGS, "--fractions", "1", "--no-limit",
                                 "--name", "gpu_readers"])
    print("\n## Prefetch hit rate (kvikio reader)\n")
    prefetch = ["--index", str(args.index), "--scifact", str(args.scifact), "--scifact-data", str(args.scifact_data),
                "--params", args.params, "--reader", "kvikio", "--name", "gpu_prefetch"]
    status |= bench_prefetch.main(prefetch + (["--quick"] if args.quick else []))
    write_results("gpu", info)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
