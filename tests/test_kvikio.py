"""The kvikio reader's logic, on a CPU-only machine, through a fake kvikio.

Every test here except the signature checks uses the `fake_kvikio` fixture: the fake
package in tests/fakes/kvikio, which STANDS IN FOR A GPU (and for kvikio, which cannot
read without libcuda). It has the signatures of kvikio 26.10 (checked below against the
record taken from the real wheel, and against the real package or a wheel where one is
found) and reads with plain POSIX preads on a thread pool that behaves like kvikio's
(pool size, small-read shortcut, task split, EOF error). What is real: the reader's
planning, configuration, futures handling, buffer pools and the parse; the bytes are
compared with the memory reader and with the arrays that were written.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import threading
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from fakes import kvikio_api
from helpers import wait_until
from test_store import LAYOUTS, Store, assert_batch_equal, random_counts, write_store

import espn.store.buffers as buffers_module
import espn.store.kvikio as kvikio_module
from espn.errors import IndexCorruptError
from espn.store import KvikioReader, default_reader_name, open_reader
from espn.store.engines import StoreClosedError
from espn.store.engines.ownership import LEDGER
from espn.store.kvikio import DEFAULT_GDS_THRESHOLD, DEFAULT_NTHREADS, DEFAULT_TASK_SIZE, DeviceBufferPool


@pytest.fixture(params=LAYOUTS, ids=lambda lay: f"B{lay.block_size}")
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    rng = np.random.default_rng(request.param.block_size + 1)
    return write_store(tmp_path, request.param, random_counts(rng, 200, request.param))


class FakeCudaEvent:
    """Stands in for torch.cuda.Event (no GPU here): pending until the test completes it."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


@pytest.fixture
def device_branch(monkeypatch: pytest.MonkeyPatch) -> list[FakeCudaEvent]:
    """The device-buffer branch with CPU tensors STANDING IN FOR CUDA MEMORY and fake events
    for CUDA events: only the device check and the event are patched, the pool is real."""
    events: list[FakeCudaEvent] = []

    def record(device: torch.device) -> FakeCudaEvent:
        events.append(FakeCudaEvent())
        events[-1].done = True  # the parse "ran": tests that want it pending say so
        return events[-1]

    monkeypatch.setattr(KvikioReader, "_is_cuda_device", lambda self: True)
    monkeypatch.setattr(buffers_module, "_record_event", record)
    return events


# -- the fake follows the real API -------------------------------------------------------------


def fake_signatures() -> dict:
    import fakes.kvikio.cufile
    import fakes.kvikio.defaults

    return kvikio_api.signatures_from_modules({"cufile": fakes.kvikio.cufile, "defaults": fakes.kvikio.defaults})


def test_kvikio_fake_has_the_recorded_real_signatures() -> None:
    record = kvikio_api.load_record()
    assert record["version"].startswith("26.10")
    assert set(record["signatures"]) == {f"{m}.{n}" for m, names in kvikio_api.API.items() for n in names}
    assert fake_signatures() == record["signatures"]
    import fakes.kvikio as fake

    observed = record["observed_by_import"]
    assert {m.name: m.value for m in fake.CompatMode} == observed["CompatMode"]
    fake._fake.reset()
    assert {k: fake.defaults.get(k) for k in observed["defaults"]} == {
        **observed["defaults"], "compat_mode": fake.CompatMode.AUTO}


def find_kvikio_wheel() -> Path | None:
    """A kvikio wheel to read signatures from: $ESPN_KVIKIO_WHEEL, or one in pip's download dirs."""
    if os.environ.get("ESPN_KVIKIO_WHEEL"):
        return Path(os.environ["ESPN_KVIKIO_WHEEL"])
    found = sorted(glob.glob("/tmp/*/kvikio_cu1[23]-*.whl"))
    return Path(found[-1]) if found else None


def test_kvikio_fake_matches_the_real_package_where_one_is_found() -> None:
    # A changed kvikio API fails here: against the installed package, else against a wheel.
    if importlib.util.find_spec("kvikio") is not None and "fakes" not in str(importlib.util.find_spec("kvikio")):
        import kvikio.cufile
        import kvikio.defaults

        real = kvikio_api.signatures_from_modules({"cufile": kvikio.cufile, "defaults": kvikio.defaults})
        assert real == fake_signatures()
        return
    wheel = find_kvikio_wheel()
    if wheel is None:
        pytest.skip("neither kvikio nor a kvikio wheel here (set ESPN_KVIKIO_WHEEL to a kvikio_cu12 wheel)")
    assert kvikio_api.signatures_from_wheel(wheel)["signatures"] == fake_signatures(), wheel.name


# -- configuration ------------------------------------------------------------------------------


def test_kvikio_configuration_applies_to_the_real_package_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    # kvikio imports and takes its settings without libcuda (only reads need it), so where
    # the real package is installed the configuration step runs against it, GPU or not.
    spec = importlib.util.find_spec("kvikio")
    if spec is None or "fakes" in str(spec.origin):
        pytest.skip("kvikio is not installed here (the fake covers the configuration below)")
    try:
        import kvikio.defaults
    except Exception as exc:  # a missing libkvikio or librapids_logger
        pytest.skip(f"kvikio does not import here: {exc}")
    from espn.store.kvikio import KvikioConfig, configure_kvikio

    monkeypatch.setattr(kvikio_module, "_applied", {})
    monkeypatch.setattr(kvikio_module, "_open_readers", 0)
    keys = ("num_threads", "gds_threshold", "task_size", "bounce_buffer_size", "compat_mode")
    before = {k: kvikio.defaults.get(k) for k in keys}
    try:
        got = configure_kvikio(kvikio, KvikioConfig(nthreads=3, compat_mode="on"))
        assert got == {"num_threads": 3, "gds_threshold": 4096, "task_size": 1 << 20, "bounce_buffer_size": 1 << 20,
                       "compat_mode": "on"}
        assert kvikio.defaults.is_compat_mode_preferred()
    finally:
        kvikio.defaults.set(before)




def test_kvikio_configures_the_pool_and_threshold_at_open(store: Store, fake_kvikio: ModuleType) -> None:
    # Fake kvikio standing in for a GPU; it starts as kvikio 26.10 does: 1 thread, 16 KiB.
    fake = fake_kvikio._fake
    assert fake.settings["num_threads"] == 1 and fake.settings["gds_threshold"] == 16 << 10
    with open_reader("kvikio", store.path, store.records, store.layout) as reader:
        assert fake.settings["num_threads"] == DEFAULT_NTHREADS == 16
        assert fake.pool._max_workers == 16
        assert fake.settings["gds_threshold"] == DEFAULT_GDS_THRESHOLD == 4096
        assert fake.settings["task_size"] == DEFAULT_TASK_SIZE
        info = reader.describe()
        assert info["reader"] == "kvikio" and info["engine"] == reader.engine == "kvikio-compat"
        assert (info["nthreads"], info["gds_threshold"], info["task_size"]) == (16, 4096, 1 << 20)
        assert info["bounce_buffer_size"] == 1 << 20 and info["compat_mode"] == "auto"
        assert info["device_buffers"] is False and info["kvikio_version"] == "26.10.00"
    # The reader's options override kvikio's settings (which KVIKIO_* variables set at start).
    fake.settings["num_threads"], fake.settings["bounce_buffer_size"] = 3, 16 << 20
    with KvikioReader(store.path, store.records, store.layout, nthreads=8, gds_threshold=0,
                      task_size=1 << 16, bounce_buffer_size=None, compat_mode="off") as reader:
        assert fake.settings["num_threads"] == 8 and fake.pool._max_workers == 8
        assert fake.settings["gds_threshold"] == 0 and fake.settings["task_size"] == 1 << 16
        assert fake.settings["bounce_buffer_size"] == 16 << 20  # None: left as kvikio had it
        assert reader.engine == "kvikio-gds" and reader.describe()["compat_mode"] == "off"
    # Unchanged settings are not set again (resizing the pool waits for running tasks).
    before = len(fake.set_calls)
    with KvikioReader(store.path, store.records, store.layout, nthreads=8, gds_threshold=0,
                      task_size=1 << 16, bounce_buffer_size=None, compat_mode="off"):
        assert len(fake.set_calls) == before
    # AUTO resolves to cuFile where the system has it.
    fake.gds_unavailable = False
    with KvikioReader(store.path, store.records, store.layout, compat_mode="auto") as reader:
        assert reader.engine == "kvikio-gds"


def test_kvikio_options_are_checked(store: Store, fake_kvikio: ModuleType) -> None:
    # Fake kvikio standing in for a GPU.
    for bad in ({"nthreads": 0}, {"nthreads": 2.5}, {"gds_threshold": -1}, {"task_size": 100},
                {"compat_mode": "maybe"}, {"max_extent_bytes": 0}, {"bounce_buffer_size": True}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            KvikioReader(store.path, store.records, store.layout, **bad)
    with pytest.raises(ValueError, match="unknown option"):
        open_reader("kvikio", store.path, store.records, store.layout, io_depth=4)
    assert default_reader_name() == "kvikio"  # kvikio and "CUDA" both present


# -- reads ---------------------------------------------------------------------------------------


def test_kvikio_reads_what_was_written_and_agrees_with_memory(store: Store, fake_kvikio: ModuleType) -> None:
    # Fake kvikio standing in for a GPU; host buffers (device="cpu").
    rng = np.random.default_rng(5)
    n = len(store.records)
    requests = [rng.integers(0, n, size=50), np.array([n - 1, 0, 0]), np.arange(n)[::-1].copy(), [2]]
    with open_reader("kvikio", store.path, store.records, store.layout) as kv, \
            open_reader("memory", store.path, store.records, store.layout) as mem:
        for docs in requests:
            got, want = kv.read(docs), mem.read(docs)
            assert_batch_equal(got, store.expected(np.asarray(docs)))
            assert torch.equal(got.cls, want.cls) and torch.equal(got.vectors, want.vectors)
            np.testing.assert_array_equal(got.offsets, want.offsets)
            assert got.ios >= 1 and got.bytes_read % store.layout.block_size == 0


def test_kvikio_issues_every_extent_before_any_wait(store: Store, fake_kvikio: ModuleType) -> None:
    # Fake kvikio standing in for a GPU: its pool holds every read until the test lets go.
    fake = fake_kvikio._fake
    lay = store.layout
    docs = np.arange(0, len(store.records), 9)  # spread out: many separate extents
    with KvikioReader(store.path, store.records, lay, max_extent_bytes=lay.block_size) as reader:
        fake.trace.clear()
        fake.release.clear()
        pending = reader.submit(docs)  # returns with the reads in flight
        preads = [e for e in fake.trace if e[0] == "pread"]
        assert len(preads) > DEFAULT_NTHREADS
        assert not [e for e in fake.trace if e[0] in ("get", "task")]
        assert all(e[3] == threading.current_thread().name for e in preads)
        # kvikio's pool runs 16 of them at once (it would be 1 without the reader's setting).
        wait_until(lambda: fake.in_flight == DEFAULT_NTHREADS, f"{DEFAULT_NTHREADS} reads in flight", 10.0, 0.005)
        fake.release.set()
        batch = pending.result()
        assert batch.ios == len(preads)
        kinds = [e[0] for e in fake.trace]
        assert kinds.index("get") > max(i for i, k in enumerate(kinds) if k == "pread")
        assert fake.max_in_flight == DEFAULT_NTHREADS
    assert_batch_equal(batch, store.expected(docs))


def test_kvikio_failed_extent_waits_for_the_others_then_raises(store: Store, fake_kvikio: ModuleType) -> None:
    # Fake kvikio standing in for a GPU: one extent fails at once, the others are held.
    fake = fake_kvikio._fake
    lay = store.layout
    docs = np.arange(0, len(store.records), 11)
    with KvikioReader(store.path, store.records, lay, max_extent_bytes=lay.block_size) as reader:
        first = int(store.records[docs[3]]["offset"]) // lay.block_size * lay.block_size
        fake.fail[first] = RuntimeError("KvikIO failure: injected read error")
        fake.release.clear()
        pending = reader.submit(docs)
        outcome: list[BaseException] = []

        def consume() -> None:  # the result is taken on another thread, as a re-rank worker does
            try:
                pending.result()
            except BaseException as exc:
                outcome.append(exc)

        worker = threading.Thread(target=consume)
        worker.start()
        worker.join(0.3)
        assert worker.is_alive(), "raised while other reads were still writing into the buffer"
        fake.release.set()
        worker.join(10)
        assert len(outcome) == 1 and "injected" in str(outcome[0])
        assert fake.in_flight == 0
        assert len([e for e in fake.trace if e[0] == "task"]) == len([e for e in fake.trace if e[0] == "pread"])
        # The buffer went back to the pool, and the reader still works.
        fake.fail.clear()
        assert_batch_equal(reader.read(docs), store.expected(docs))


def test_kvikio_end_of_file(tmp_path: Path, fake_kvikio: ModuleType) -> None:
    # Fake kvikio standing in for a GPU; like libkvikio it raises at EOF instead of
    # returning a short count, so the reader clamps the last extent to the file.
    lay = LAYOUTS[0]
    store = write_store(tmp_path, lay, [3, 0, 40, 5, 7], pad=False)
    size = store.path.stat().st_size
    assert size % lay.block_size
    with fake_kvikio.CuFile(store.path) as f, pytest.raises(RuntimeError, match="EOF"):
        f.read(np.zeros(lay.block_size, np.uint8), lay.block_size, size - size % lay.block_size)
    fake = fake_kvikio._fake
    docs = np.array([4, 2, 0, 4])
    with KvikioReader(store.path, store.records, lay) as reader:
        fake.trace.clear()
        batch = reader.read(docs)
        assert_batch_equal(batch, store.expected(docs))
        last = max((e for e in fake.trace if e[0] == "pread"), key=lambda e: e[1])
        assert last[1] + last[2] == size  # clamped, not a whole block
        # A file that shrinks under an open reader is reported, not zero-filled.
        os.truncate(store.path, size - 10)
        with pytest.raises(IndexCorruptError, match="ended before"):
            reader.read(docs)


# -- the device-buffer branch ---------------------------------------------------------------------


def test_kvikio_device_buffers_from_the_pool(store: Store, fake_kvikio: ModuleType,
                                             device_branch: list[FakeCudaEvent]) -> None:
    # STANDS IN FOR A GPU: the fake kvikio, CPU tensors as CUDA memory, fake CUDA events.
    fake = fake_kvikio._fake
    lay = store.layout
    docs = np.random.default_rng(7).integers(0, len(store.records), size=40)
    with KvikioReader(store.path, store.records, lay, gds_threshold=lay.block_size) as reader, \
            open_reader("memory", store.path, store.records, lay) as mem:
        assert reader.device_buffers and reader.describe()["device_buffers"]
        fake.trace.clear()
        first = reader.read(docs)
        want = mem.read(docs)
        assert torch.equal(first.cls, want.cls) and torch.equal(first.vectors, want.vectors)
        assert not [e for e in fake.trace if e[0] == "shortcut"]  # one block = the threshold: pool
        pool = reader._device_pool
        assert pool is not None and len(device_branch) == 1  # one event per wave, at release
        (size, free), = pool._free.items()
        buf = free[0][0]
        # Event done: the same buffer is handed out again, with no wait.
        assert pool.acquire(size) is buf
        pool.release(buf)
        # Event pending (the parse kernels not run yet): a new buffer, still no wait.
        device_branch[-1].done = False
        other = pool.acquire(size)
        assert other is not buf and not device_branch[-1].waited
        pool.release(other)
        # At the cap: wait for the oldest event rather than grow.
        pool.retain_bytes = pool._held
        for _, event in pool._free[size]:
            assert isinstance(event, FakeCudaEvent)
            event.done = False
        again = pool.acquire(size)
        assert again is buf and device_branch[-2].waited
        pool.release(again)
        assert_batch_equal(reader.read(docs), store.expected(docs))


def test_kvikio_small_device_reads_take_the_synchronous_shortcut(
        store: Store, fake_kvikio: ModuleType, device_branch: list[FakeCudaEvent]) -> None:
    # STANDS IN FOR A GPU (fake kvikio, CPU tensors as CUDA memory). With kvikio's own
    # threshold (16 KiB) one-block device reads are done in the caller's thread during
    # submit, one at a time: why the reader sets the threshold to 4096.
    fake = fake_kvikio._fake
    lay = store.layout
    docs = np.arange(0, len(store.records), 13)
    with KvikioReader(store.path, store.records, lay, gds_threshold=16 << 10,
                      max_extent_bytes=lay.block_size) as reader:
        fake.trace.clear()
        fake.release.clear()
        done = threading.Event()

        def submit() -> None:
            reader.submit(docs).result()
            done.set()

        threading.Thread(target=submit, daemon=True).start()
        assert not done.wait(0.3)  # the first shortcut read blocks the submitting thread
        fake.release.set()
        assert done.wait(10)
        assert {e[0] for e in fake.trace} >= {"shortcut"} and fake.max_in_flight == 1


def test_kvikio_result_on_another_thread_and_concurrent_waves(store: Store, fake_kvikio: ModuleType,
                                                              device_branch: list[FakeCudaEvent]) -> None:
    # STANDS IN FOR A GPU. Waves submitted by one thread, results taken by workers (the
    # searcher's early re-rank on CUDA), several waves in flight over one buffer pool.
    rng = np.random.default_rng(11)
    n = len(store.records)
    waves = [rng.integers(0, n, size=int(rng.integers(1, 60))) for _ in range(12)]
    with KvikioReader(store.path, store.records, store.layout) as reader:
        pending = [reader.submit(docs) for docs in waves]
        results: list = [None] * len(waves)

        def take(i: int) -> None:
            results[i] = pending[i].result()

        threads = [threading.Thread(target=take, args=(i,)) for i in range(len(waves))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        for docs, batch in zip(waves, results):
            assert_batch_equal(batch, store.expected(docs))
        assert pending[0].result() is results[0]  # result() is idempotent


# -- lifetimes: no buffer goes back while kvikio may write into it -------------------------------


def test_kvikio_close_from_another_thread_waits_for_the_waves_in_flight(
        store: Store, fake_kvikio: ModuleType, device_branch: list[FakeCudaEvent]) -> None:
    # STANDS IN FOR A GPU: the fake kvikio holds the reads; CPU tensors stand in for device memory.
    fake = fake_kvikio._fake
    docs = np.arange(0, len(store.records), 7)
    # gds_threshold=0: the short last extent of the file goes to the pool too, not the shortcut.
    reader = KvikioReader(store.path, store.records, store.layout, gds_threshold=0)
    fake.release.clear()
    pending = reader.submit(docs)
    closer = threading.Thread(target=reader.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close returned while kvikio was still reading into a wave's buffer"
    with pytest.raises(StoreClosedError, match="closed"):
        reader.submit(docs)
    fake.release.set()
    closer.join(10)
    assert not closer.is_alive()
    # The held reads ran against a file that was still open (the fake refuses a closed one).
    assert_batch_equal(pending.result(), store.expected(docs))
    pool = reader.buffer_pool
    assert pool.stats()["quarantined"] == 0 and LEDGER.outstanding() == 0
    pool.check()


def test_kvikio_abandoned_wave_gives_its_device_buffer_back_only_once_read(
        store: Store, fake_kvikio: ModuleType, device_branch: list[FakeCudaEvent]) -> None:
    # STANDS IN FOR A GPU (fake kvikio, CPU tensors as device memory, fake CUDA events).
    fake = fake_kvikio._fake
    docs = np.arange(0, len(store.records), 5)
    with KvikioReader(store.path, store.records, store.layout, gds_threshold=0) as reader:
        fake.release.clear()
        pending = reader.submit(docs)
        abandon = threading.Thread(target=pending.discard)  # a search that failed after its wave started
        abandon.start()
        abandon.join(0.3)
        assert abandon.is_alive() and reader.buffer_pool.stats()["free"] == 0
        fake.release.set()
        abandon.join(10)
        stats = reader.buffer_pool.stats()
        assert stats["free"] == 1 and stats["quarantined"] == 0, stats
        reader.buffer_pool.check()  # nothing wrote into it after it came back
        assert_batch_equal(reader.read(docs), store.expected(docs))


def test_kvikio_device_buffer_beyond_the_cap_is_freed_only_after_its_event(
        fake_kvikio: ModuleType, device_branch: list[FakeCudaEvent]) -> None:
    # STANDS IN FOR A GPU: CPU tensors as device memory, fake CUDA events the test completes.
    pool = DeviceBufferPool(torch.device("cpu"), retain_bytes=1 << 16)
    a, b = pool.acquire(1 << 16), pool.acquire(1 << 16)  # 128 KiB held: over the cap
    pool.release(a)
    device_branch[-1].done = False  # the parse that reads `a` has not run yet
    assert pool.stats()["retiring"] == 1
    c = pool.acquire(1 << 16)
    assert c is not a and pool.stats()["retiring"] == 1  # still held back from torch's allocator
    device_branch[-1].done = True
    pool.release(b)  # over the cap too: retiring, its (fake) parse already done
    pool.acquire(1 << 16)  # frees both retiring buffers, allocates one
    stats = pool.stats()
    assert stats["retiring"] == 0 and stats["held_bytes"] == 2 << 16, stats  # c and the new one
    # close: a free buffer whose parse is still queued is waited for before it is dropped.
    pool.release(c)
    device_branch[-1].done = False
    pool.clear()
    assert device_branch[-1].waited


def test_kvikio_keeps_each_extent_within_one_task(store: Store, fake_kvikio: ModuleType) -> None:
    # Fake kvikio standing in for a GPU. A future of several tasks raises at the first failed
    # one while the others may still write: the reader never issues such a read.
    fake = fake_kvikio._fake
    docs = np.arange(len(store.records))
    with KvikioReader(store.path, store.records, store.layout, task_size=8192) as reader:
        assert reader.max_extent_bytes == 8192
        fake.trace.clear()
        assert_batch_equal(reader.read(docs), store.expected(docs))
        preads = [e for e in fake.trace if e[0] == "pread"]
        tasks = [e for e in fake.trace if e[0] == "task"]
        assert len(tasks) == len(preads) and max(e[2] for e in preads) <= 8192


# -- deployment ----------------------------------------------------------------------------------


def test_kvikio_variables_in_deploy_match_the_reader_defaults() -> None:
    # The image and the GPU overlay start kvikio as the reader will configure it.
    import yaml

    from espn.store.kvikio import DEFAULT_BOUNCE_BUFFER_SIZE

    want = {"KVIKIO_NTHREADS": str(DEFAULT_NTHREADS), "KVIKIO_GDS_THRESHOLD": str(DEFAULT_GDS_THRESHOLD),
            "KVIKIO_TASK_SIZE": str(DEFAULT_TASK_SIZE), "KVIKIO_BOUNCE_BUFFER_SIZE": str(DEFAULT_BOUNCE_BUFFER_SIZE),
            "KVIKIO_COMPAT_MODE": "AUTO"}
    root = Path(__file__).resolve().parents[1] / "deploy"
    dockerfile = (root / "Dockerfile.cuda").read_text().replace("\\\n", " ")
    image = dict(re.findall(r"\b(KVIKIO_[A-Z_]+)=(\S+)", dockerfile))
    assert image == want
    server = yaml.safe_load((root / "k8s/overlays/gpu/server-gpu.yaml").read_text())
    (container,) = server["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("KVIKIO_")} == want
