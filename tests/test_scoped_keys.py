"""API keys scoped to indexes and roles (server.auth), against a real `espn serve` with an index root
of two indexes and a keys file, and through the router: per route and per index, a key reaches
only what its role and its indexes allow; /readyz without a key says only ready or not; the file
is reloaded without a restart; a bad file stops the server at start in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from starlette.testclient import TestClient

from espn_server.auth import MAX_KEYS_FILE_BYTES, check_keys_file, key_digest
from espn_server.router import RouterSettings, build_router_app
from helpers import HTTP_TIMEOUT_S, wait_until
from server_fixtures import HTTP, ServerProcess, running_server

FULL = "full-access-key-0123456789abcdef"
# The server's default index is `a` (its routes /v1/search, ... are a's: its name is its directory's).
KEYS = {"reader-a": ("read", ["a"]), "writer-a": ("write", ["a"]), "admin-t": ("admin", ["t-*"]),
        "reader-all": ("read", ["*"])}
SECRET = {name: f"{name}-secret-0123456789abcdef" for name in KEYS}
QUERY = {"query": "the speed of light", "k": 3}


def _keys_file(path: Path, names: list[str]) -> Path:
    entries = [{"name": n, "sha256": key_digest(SECRET[n]), "role": KEYS[n][0], "indexes": KEYS[n][1]} for n in names]
    path.write_text(json.dumps({"keys": entries}))
    return path


@pytest.fixture(scope="module")
def root(sample_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("scoped")
    for name in ("a", "b"):
        shutil.copytree(sample_index, root / "indexes" / name)
    _keys_file(root / "keys.json", list(KEYS))
    return root


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerProcess]:
    with running_server(root / "indexes" / "a", root, "--index-root", str(root / "indexes"), "--model", "small=minilm",
                        "--api-keys-file", str(root / "keys.json"), env={"ESPN_API_KEY": FULL},
                        name="scoped") as server:
        yield server


def _as(key: str | None, server: ServerProcess, method: str, path: str, body: Any = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {SECRET.get(key, key)}"} if key is not None else {}
    return HTTP.request(method, server.base_url + path, json=body, headers=headers)


@pytest.mark.parametrize("key, method, path, body, status", [
    ("reader-a", "POST", "/v1/indexes/a/search", QUERY, 200),
    ("reader-a", "GET", "/v1/indexes/a/documents/s0001", None, 200),
    ("reader-a", "GET", "/v1/indexes/a", None, 200),
    ("reader-a", "POST", "/v1/indexes/b/search", QUERY, 403),
    ("reader-a", "GET", "/v1/indexes/b/documents/s0001", None, 403),
    ("reader-a", "PUT", "/v1/indexes/a/documents/x", {"text": "no"}, 403),
    ("reader-a", "DELETE", "/v1/indexes/a/documents/s0002", None, 403),
    ("reader-a", "POST", "/v1/indexes", {"name": "a2", "model": "small"}, 403),
    ("reader-a", "DELETE", "/v1/indexes/a", None, 403),
    ("writer-a", "PUT", "/v1/indexes/a/documents/by-writer", {"text": "Written by a writer of a."}, 201),
    ("writer-a", "PUT", "/v1/indexes/b/documents/by-writer", {"text": "Not b."}, 403),
    ("writer-a", "POST", "/v1/indexes/a/snapshots", None, 403),
    ("writer-a", "POST", "/v1/indexes/a/refit", None, 403),
    ("admin-t", "POST", "/v1/indexes", {"name": "x-1", "model": "small"}, 403),
    ("admin-t", "POST", "/v1/indexes/a/search", QUERY, 403),
    ("reader-all", "POST", "/v1/indexes/b/search", QUERY, 200),
    ("reader-all", "PUT", "/v1/indexes/b/documents/x", {"text": "no"}, 403),
    (None, "POST", "/v1/indexes/a/search", QUERY, 401),
    ("not-a-key-at-all-0123456789", "POST", "/v1/indexes/a/search", QUERY, 401),
    (FULL, "POST", "/v1/indexes/b/search", QUERY, 200),
])
def test_each_key_reaches_what_its_role_and_indexes_allow(server: ServerProcess, key: str | None, method: str,
                                                          path: str, body: Any, status: int) -> None:
    response = _as(key, server, method, path, body)
    assert response.status_code == status, response.text
    if status == 403:
        assert response.json()["error"] == "forbidden" and "needs" in response.json()["message"] or \
            "may not create" in response.json()["message"]


def test_an_admin_creates_and_deletes_only_indexes_of_its_names(server: ServerProcess) -> None:
    made = _as("admin-t", server, "POST", "/v1/indexes", {"name": "t-1", "model": "small"})
    assert made.status_code == 201, made.text
    assert _as("admin-t", server, "POST", "/v1/indexes/t-1/search", QUERY).status_code == 200
    assert _as("admin-t", server, "DELETE", "/v1/indexes/t-1").status_code == 204


def test_the_listing_and_readiness_show_only_what_a_key_reaches(server: ServerProcess) -> None:
    listed = _as("reader-a", server, "GET", "/v1/indexes").json()["indexes"]
    assert [item["name"] for item in listed] == ["a"]
    bare = HTTP.get(server.base_url + "/readyz")
    assert bare.status_code == 200 and bare.json() == {"status": "ready"}, bare.text
    scoped = _as("reader-a", server, "GET", "/readyz").json()
    assert [item["name"] for item in scoped["indexes"]] == ["a"]
    assert {item["name"] for item in _as(FULL, server, "GET", "/readyz").json()["indexes"]} >= {"a", "b"}


def test_the_keys_file_is_reloaded_without_a_restart(server: ServerProcess, root: Path) -> None:
    _keys_file(root / "keys.json", ["writer-a", "admin-t", "reader-all"])  # reader-a revoked
    wait_until(lambda: _as("reader-a", server, "POST", "/v1/indexes/a/search", QUERY).status_code == 401,
               "the revoked key to be refused", timeout_s=30)
    assert _as("writer-a", server, "POST", "/v1/indexes/a/search", QUERY).status_code == 200
    (root / "keys.json").write_text("{not json")  # a file that no longer reads keeps the keys read last
    wait_until(lambda: _as("writer-a", server, "POST", "/v1/indexes/a/search", QUERY).status_code == 200
               and "no longer reads" in server.log(), "the bad file to be logged", timeout_s=30)
    assert _as("writer-a", server, "POST", "/v1/indexes/a/search", QUERY).status_code == 200
    _keys_file(root / "keys.json", list(KEYS))
    wait_until(lambda: _as("reader-a", server, "POST", "/v1/indexes/a/search", QUERY).status_code == 200,
               "the key to be accepted again", timeout_s=30)


def test_the_router_checks_the_key_and_the_partitions_check_it_again(server: ServerProcess, root: Path) -> None:
    settings = RouterSettings(shards=[server.base_url], writers=[server.base_url], timeout_ms=HTTP_TIMEOUT_S * 1000,
                              api_keys_file=root / "keys.json")
    with TestClient(build_router_app(settings)) as router:
        def call(key: str | None, method: str, path: str, body: Any = None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {SECRET[key]}"} if key is not None else {}
            return router.request(method, path, json=body, headers=headers)

        assert call("reader-a", "POST", "/v1/indexes/a/search", QUERY).status_code == 200
        assert call("reader-a", "POST", "/v1/indexes/b/search", QUERY).status_code == 403
        assert call("reader-a", "PUT", "/v1/indexes/a/documents/via-router", {"text": "no"}).status_code == 403
        assert call(None, "POST", "/v1/indexes/a/search", QUERY).status_code == 401
        assert call("writer-a", "PUT", "/v1/indexes/a/documents/via-router", {"text": "Routed."}).status_code == 201


def test_a_keys_file_that_does_not_read_stops_the_server_in_one_line(root: Path, tmp_path: Path) -> None:
    bad = tmp_path / "keys.json"
    bad.write_text(json.dumps({"keys": [{"name": "x", "sha256": "not-hex", "role": "read", "indexes": ["a"]}]}))
    done = subprocess.run([sys.executable, "-m", "espn.cli", "serve", "--index-root", str(root / "indexes"),
                           "--api-keys-file", str(bad), "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("espn serve: error: api_keys_file") and "sha256" in last, done.stderr


def test_a_keys_file_is_read_as_input_from_outside(tmp_path: Path) -> None:
    """A FIFO is refused without blocking, an oversized or deeply nested file before it is parsed;
    a link is followed (a Kubernetes Secret's files are links), as the server reads it at start
    and at each reload."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * (MAX_KEYS_FILE_BYTES + 1))
    deep = tmp_path / "deep.json"
    deep.write_text('{"keys": ' + "[" * 10_000 + "]" * 10_000 + "}")
    for path, words in [(fifo, "a FIFO, not a regular file"), (huge, f"at most {MAX_KEYS_FILE_BYTES}"),
                        (deep, "nested")]:
        with pytest.raises(ValueError, match=words) as refused:
            check_keys_file(path)
        assert "\n" not in str(refused.value)
    real = tmp_path / "secret" / "keys.json"
    real.parent.mkdir()
    real.write_text(json.dumps({"keys": [{"name": "x", "sha256": key_digest("k" * 32), "role": "read",
                                          "indexes": ["a"]}]}))
    (tmp_path / "keys.json").symlink_to(real)
    assert [p.name for p in check_keys_file(tmp_path / "keys.json")] == ["x"]


def test_key_hash_prints_the_digest_a_keys_file_holds() -> None:
    done = subprocess.run([sys.executable, "-m", "espn.cli", "key-hash"], input="some-key\n", capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == key_digest("some-key"), done.stderr
