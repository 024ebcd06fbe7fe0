"""Shared fixtures: the SciFact data by path (skipped cleanly where absent), small corpora, built indexes.

Under pytest-xdist (`make test` runs `pytest -n ...`) each worker is its own session; the
built indexes are still built once for the whole run (`built_once`), by whichever worker asks
first, while the others wait for it. Tests only read them (a test that writes copies first).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator

# As `espn` sets it for itself (espn/cli/__init__.py), before torch loads OpenMP: the test processes'
# own torch threads then sleep while they wait. Spinning instead took 20-30% more CPU on 2 shared
# cores in the search-heavy files (test_searcher.py with test_maxsim.py, two copies at once).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
from benchmarks.scaleout import Cluster, Store  # noqa: E402
from helpers import run_espn, write_scifact_subset  # noqa: E402
from server_fixtures import ServerProcess, running_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCIFACT = Path(os.environ.get("ESPN_SCIFACT", ROOT.parent / "shared" / "data" / "scifact"))
SAMPLE_CORPUS = ROOT / "espn" / "data" / "sample_corpus.jsonl"
CHROMIUM = Path(os.environ.get("ESPN_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("ESPN_CHROMEDRIVER", "/usr/bin/chromedriver"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a `slow` test first, the rest in their order: `make test` sends each file to one
    xdist worker, and a long file handed out last would run alone while the other workers idle.
    Under `make test` xdist hands out the files with the most tests first (its loadscope reorder),
    so there this order only breaks ties. Honouring it (--no-loadscope-reorder) was measured in
    one fresh-clone rehearsal: 19 min 34 s against 19 min 48 s, inside the noise, with the slow
    files' servers contending with each other; not kept."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(autouse=True, scope="session")
def strict_buffer_ownership() -> Iterator[None]:
    """Every test runs under the strict ownership policy: a read buffer given back to its pool
    while a read still targets it raises OwnershipError, and given-back buffers carry a canary
    that is checked when they are handed out again (see espn/store/engines/base.py)."""
    from espn.store.engines import OwnershipPolicy, set_ownership_policy

    previous = set_ownership_policy(OwnershipPolicy(strict=True, canary=True))
    yield
    set_ownership_policy(previous)


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object],
               leaf: str = "index") -> Path:
    """`build(path)` run once per test run, its `path` returned to every session that asks.

    Without xdist: a fresh directory of this session. With xdist: a directory beside the
    workers' own temporary directories, built by the first worker under an exclusive lock
    while the others block on it; a `.done` file beside it marks a finished build (a build
    that failed is tried again by the next worker, which then fails the same way)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        out = tmp_path_factory.mktemp(name) / leaf
        build(out)
        return out
    shared = tmp_path_factory.getbasetemp().parent / "shared" / name
    shared.mkdir(parents=True, exist_ok=True)
    out, done = shared / leaf, shared / f"{leaf}.done"
    with open(shared / ".lock", "w") as lock, _locked(lock.fileno()):
        if not done.exists():
            build(out)
            done.touch()
    return out


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def scifact_dir() -> Path:
    if not (SCIFACT / "corpus.jsonl.gz").is_file():
        pytest.skip(f"SciFact data not found at {SCIFACT} (set ESPN_SCIFACT to its directory)")
    return SCIFACT


@pytest.fixture(scope="session")
def scifact_subset(scifact_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 160 SciFact abstracts as a plain corpus.jsonl."""
    return built_once(tmp_path_factory, "corpus", lambda out: write_scifact_subset(scifact_dir, out, 160),
                      leaf="corpus.jsonl")


@pytest.fixture(scope="session")
def scifact_index(scifact_subset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An index of the subset built through the CLI; small chunks so resume and shards have work to split."""
    return built_once(tmp_path_factory, "index", lambda out: run_espn(
        "index", scifact_subset, "--out", out, "--chunk-size", "32", "--nlist", "4", "--no-progress"),
        leaf="scifact-160")


@pytest.fixture(scope="session")
def sample_index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample corpus (300 passages), indexed through the CLI."""
    return built_once(tmp_path_factory, "sample", lambda out: run_espn("index", SAMPLE_CORPUS, "--out", out,
                                                                         "--no-progress"))


@pytest.fixture(scope="session")
def sample_partitions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled sample corpus indexed as 2 partitions (`parts/part-0`, `parts/part-1`) through the CLI;
    a test that writes to a partition copies it first."""
    return built_once(tmp_path_factory, "partitions", lambda out: run_espn(
        "index", SAMPLE_CORPUS, "--out", out, "--partitions", "2", "--no-progress"), leaf="parts")



@pytest.fixture(scope="module")
def moto_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """moto's S3 server with one versioned bucket for one test module (the bucket named after the
    module): the object store of the scale-out tests, in process and for the processes they start."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto.server")
    server = Store("espn-" + request.module.__name__.removeprefix("test_").replace("_", "-"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def cluster(moto_store: Store, tmp_path: Path) -> Iterator[Cluster]:
    """The processes of one scale-out run against `moto_store` (their logs in tmp_path), every one
    stopped when the test ends, passed or failed."""
    running = Cluster(moto_store, tmp_path)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def colpali_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """benchmarks.make_visual_checkpoint's tiny seeded ColPali (64 px pages, 8 px patches), written
    once per test run: the model of the page tests, which only read it."""
    # Imported here: it loads transformers, which most test files never need.
    from benchmarks.make_visual_checkpoint import write_checkpoint

    return built_once(tmp_path_factory, "colpali", write_checkpoint, leaf="tiny-colpali")

#: The API key of `client_server`.
CLIENT_API_KEY = "client-test-key-0123456789"


@pytest.fixture(scope="session")
def client_server(sample_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One `espn serve` shared by tests/test_client.py and tests/test_retrievers.py: a copy of the
    sample index (the client's tests write to it), API key on, snapshots under a temporary directory."""
    root = tmp_path_factory.mktemp("client-server")
    shutil.copytree(sample_index, root / "index")
    with running_server(root / "index", root, "--snapshot-dir", str(root / "snapshots"), "--batch-wait-ms", "2",
                        env={"ESPN_API_KEY": CLIENT_API_KEY}, name="client") as server:
        yield server


@pytest.fixture
def fake_kvikio(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The fake kvikio (tests/fakes/kvikio) in place of the real one, and torch told that a
    CUDA device exists: together they STAND IN FOR A GPU on this CPU-only machine.

    The reader then opens as on a GPU machine; with device="cpu" it reads into host
    buffers, and a test that patches `KvikioReader._is_cuda_device` gets the device-buffer
    branch with CPU tensors standing in for CUDA memory.
    """
    import espn.store.kvikio as reader_module
    import fakes.kvikio as fake
    import fakes.kvikio.cufile
    import fakes.kvikio.defaults

    fake._fake.reset()
    monkeypatch.setitem(sys.modules, "kvikio", fake)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", fakes.kvikio.defaults)
    monkeypatch.setitem(sys.modules, "kvikio.cufile", fakes.kvikio.cufile)
    monkeypatch.setattr(reader_module, "_cuda_available", lambda: True)
    monkeypatch.setattr(reader_module, "_applied", {})
    monkeypatch.setattr(reader_module, "_open_readers", 0)
    reader_module._unavailable_reason.cache_clear()
    yield fake
    reader_module._unavailable_reason.cache_clear()
    fake._fake.reset()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory):
    """Debian's headless Chromium through its chromedriver (tests/test_page.py, tests/test_docs_site.py)."""
    if os.environ.get("ESPN_BROWSER_TESTS") == "0":
        pytest.skip("ESPN_BROWSER_TESTS=0 turns the browser test off")
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.is_file()]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not found: `make browser` installs Debian's chromium and "
                    "chromium-driver (or set ESPN_BROWSER_TESTS=0 to skip this test)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # Without the network switches Chromium stalls on this closed network (updates, sync, ...).
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--window-size=1200,1500",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    # The driver is given explicitly, so selenium's own driver manager never downloads one.
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()
