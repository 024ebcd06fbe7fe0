"""Loading the memory reader costs the table's size in RAM, not more (issue 34, item 4).

A real index (precomputed embeddings through `espn index`, records of 64 KiB) is opened
with the memory reader in a fresh process, which reports how far its peak resident set
(`VmHWM`) rose above its resident set before the open. Before the fix the Searcher held two
copies of the table (its live-index reader cache opened a second memory reader), so the
peak was twice the table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from espn.errors import IndexCorruptError
from espn.store.memory import load_file

ESPN = Path(sys.executable).with_name("espn")
D_CLS, D_BOW, VECTORS = 128, 128, 255  # (128 + 255 * 128) * 2 bytes = 64 KiB per record
MiB = 1 << 20

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux /proc/self/status")

PROBE = r"""
import json, sys
from pathlib import Path
from espn import Searcher

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

try:  # reset the peak to the current resident set (Linux >= 4.0); else the peak since start
    Path("/proc/self/clear_refs").write_text("5")
except OSError:
    pass
before, before_anon = status("VmRSS"), status("RssAnon")
searcher = Searcher.open(sys.argv[1], reader=sys.argv[2], with_encoder=False)
# held: anonymous memory only (the table's array), which the kernel cannot drop as it may drop
# the pages of mapped libraries when other processes need memory (RSS would then shrink).
print(json.dumps({"growth": status("VmHWM") - before, "held": status("RssAnon") - before_anon}))
searcher.close()
"""


@pytest.fixture(scope="module")
def wide_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2,048 documents of 64 KiB records: a 128 MiB embeddings.bin."""
    root = tmp_path_factory.mktemp("wide")
    source, n = root / "src", 2048
    rng = np.random.default_rng(0)
    for folder in ("cls", "bow", "counts"):
        (source / folder).mkdir(parents=True)
    (source / "embeddings.json").write_text(json.dumps(
        {"format": "espn-precomputed", "version": 1, "d_cls": D_CLS, "d_bow": D_BOW}))
    np.save(source / "cls" / "0.npy", rng.normal(size=(n, D_CLS)).astype(np.float16))
    np.save(source / "bow" / "0.npy", rng.normal(size=(n * VECTORS, D_BOW)).astype(np.float16))
    np.save(source / "counts" / "0.npy", np.full(n, VECTORS, dtype=np.int64))
    index = root / "index"
    built = subprocess.run([str(ESPN), "index", "--embeddings", str(source), "--out", str(index), "--nlist", "4"],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert built.returncode == 0, built.stderr
    return index


def probe(index: Path, reader: str) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", PROBE, str(index), reader], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_memory_reader_peaks_at_the_table_size(wide_index: Path) -> None:
    table = (wide_index / "embeddings.bin").stat().st_size
    assert table >= 128 * MiB
    posix = probe(wide_index, "posix")  # what opening costs besides the table (FAISS, records, threads)
    memory = probe(wide_index, "memory")
    margin = max(0, posix["growth"]) + 24 * MiB
    assert memory["held"] >= table * 0.95, f"the memory reader should hold the table: {memory}"
    assert memory["growth"] <= table + margin, (
        f"loading peaked {memory['growth'] / MiB:.0f} MiB above the process for a {table / MiB:.0f} MiB table "
        f"(allowed {margin / MiB:.0f} MiB over it)")


def test_load_file_reads_every_byte_in_chunks(tmp_path: Path) -> None:
    data = np.random.default_rng(1).integers(0, 256, size=3 * MiB + 123, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    loaded = load_file(path, len(data), chunk_bytes=MiB)  # four chunks, the last one short
    np.testing.assert_array_equal(loaded, data)
    np.testing.assert_array_equal(load_file(path, 1000), data[:1000])


def test_load_file_refuses_a_file_shorter_than_promised(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 5000)
    with pytest.raises(IndexCorruptError, match="shrank"):
        load_file(path, 8192, chunk_bytes=4096)
