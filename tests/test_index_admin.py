"""Creating and deleting indexes over HTTP, and the memory budget.

One module-scoped server holds a directory of indexes (`--index DIR`, the index root): `a`
(the default), `b` and `c`, copies of the sample index, with a configured model, an API key
and a memory budget that fits the default and one other copy (a created index is small). One index is created (empty, in a
fraction of a second once its model is saved), written to, searched; then the server restarts
with two workers, which keep it, see an index that appears in the root, and both forget it
once deleted through either.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from pydantic import ValidationError

from espn_client import Client, ConflictError, InvalidRequestError, NotFoundError
from espn.files.index_directory import resident_bytes
from espn.live.create import STAGING_MARK, TEMPLATES_DIR
from espn_server.settings import ServerSettings
from helpers import HTTP_TIMEOUT_S
from server_fixtures import HTTP, ServerProcess, running_server

KEY = "index-admin-test-key-0123"
#: Served under `ulimit -n` of this, the build of a created index (a child process) included.
FD_LIMIT = 256
AUTH = {"Authorization": f"Bearer {KEY}"}
QUERY = {"query": "narwhals sing in the arctic polar night", "k": 3}
DOCS = [{"id": "n1", "text": "Narwhals sing in the arctic polar night about zebra quantum tides.", "title": "Narwhals"},
        {"id": "n2", "text": "Volcanic glass forms when lava cools too quickly for crystals to grow."},
        {"id": "n3", "text": "The violin has four strings tuned in perfect fifths."}]


@pytest.fixture(scope="module")
def root(sample_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("index-admin")
    for name in ("a", "b", "c"):
        shutil.copytree(sample_index, root / "indexes" / name)
    # What a killed creation and a killed deletion leave (marked as espn's staging): removed at
    # start-up, never served; a directory of the same kind of name that espn did not make is kept.
    (root / "indexes" / ".creating-x-1234" / "index").mkdir(parents=True)
    (root / "indexes" / ".creating-x-1234" / STAGING_MARK).touch()
    shutil.copytree(sample_index, root / "indexes" / ".deleted-y-5678")
    (root / "indexes" / ".deleted-y-5678" / STAGING_MARK).touch()
    (root / "indexes" / ".deleted-mine").mkdir()
    return root


def _listing(root: Path) -> list[str]:
    """The index root's entries, but for espn's saved models (created indexes link their files)."""
    return sorted(p.name for p in (root / "indexes").iterdir() if p.name != TEMPLATES_DIR)


def _budget_mib(root: Path) -> float:
    """The default and one more copy fit, with room for a small created index; not two copies."""
    one = resident_bytes(root / "indexes" / "b")  # the registry's estimate of an open index (posix reader)
    return round((resident_bytes(root / "indexes" / "a") + 1.5 * one) / 2**20, 3)


def _serve(root: Path, name: str, *flags: str) -> Any:
    return running_server(root / "indexes" / "a", root, "--index", str(root / "indexes"), "--model", "small=minilm",
                          "--model", "broken=hf:/no/such/model",
                          "--index-memory-budget", str(_budget_mib(root)), *flags, env={"ESPN_API_KEY": KEY},
                          name=name, fd_limit=FD_LIMIT)


@pytest.fixture(scope="module")
def server(root: Path) -> Iterator[ServerProcess]:
    with _serve(root, "admin") as server:
        yield server


def _request(server: ServerProcess, method: str, path: str, body: Any = None) -> httpx.Response:
    return HTTP.request(method, server.base_url + path, json=body, headers=AUTH, timeout=120)


def _ids(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [hit["id"] for hit in response.json()["results"]]


def _indexes(server: ServerProcess) -> dict[str, dict[str, Any]]:
    response = _request(server, "GET", "/v1/indexes")
    assert response.status_code == 200, response.text
    return {item["name"]: item for item in response.json()["indexes"]}


def test_the_index_root_is_given_or_the_one_directory_of_indexes(root: Path, tmp_path: Path) -> None:
    a, indexes = root / "indexes" / "a", root / "indexes"
    assert ServerSettings(index=a, indexes=[str(indexes)]).creation_root() == indexes.resolve()
    assert ServerSettings(index=a, indexes=[f"x={a}"]).creation_root() is None  # no root: creating is off
    empty = tmp_path / "empty"
    empty.mkdir()
    settings = ServerSettings(index=a, index_root=empty, models=["small=minilm", "big=hf:/models/big"])
    assert settings.creation_root() == empty.resolve() and list(settings.index_map()) == ["default"]
    assert settings.model_map() == {"small": "minilm", "big": "hf:/models/big"}
    with pytest.raises(ValidationError, match="NAME=SPEC"):
        ServerSettings(index=a, models=["minilm"])


def test_leftovers_of_killed_creations_and_deletions_are_removed(server: ServerProcess, root: Path) -> None:
    assert _listing(root) == [".deleted-mine", "a", "b", "c"]  # what espn did not make stays
    assert "removed leftovers" in server.log()


def test_creating_and_deleting_need_the_api_key(server: ServerProcess) -> None:
    for method, path, body in [("POST", "/v1/indexes", {"name": "x", "model": "small"}),
                               ("DELETE", "/v1/indexes/b", None)]:
        response = HTTP.request(method, server.base_url + path, json=body)
        assert response.status_code == 401 and response.json()["error"] == "unauthorized", (method, path)
    assert "b" in _indexes(server)


@pytest.mark.parametrize("body, status, code, words", [
    ({"name": "x", "model": "large"}, 422, "unknown_model", "small"),  # the configured models are listed
    ({"name": "-x", "model": "small"}, 422, "invalid_request", "letters, digits"),
    ({"name": "a/b", "model": "small"}, 422, "invalid_request", "letters, digits"),
    ({"name": "b", "model": "small"}, 409, "index_exists", "exists"),
    ({"name": "x"}, 422, "invalid_request", "model"),
    ({"name": "x", "model": "small", "extra": 1}, 422, "invalid_request", "extra"),
])
def test_bad_creations_are_refused(server: ServerProcess, body: Any, status: int, code: str, words: str) -> None:
    response = _request(server, "POST", "/v1/indexes", body)
    assert response.status_code == status and response.json()["error"] == code, response.text
    assert words in response.text


def test_a_failed_creation_is_a_503_that_leaves_nothing_behind(server: ServerProcess, root: Path) -> None:
    response = _request(server, "POST", "/v1/indexes", {"name": "never", "model": "broken"})
    assert response.status_code == 503 and response.json()["error"] == "create_failed", response.text
    assert "/no/such/model" in response.json()["message"]
    assert _listing(root) == [".deleted-mine", "a", "b", "c"]
    assert "never" not in _indexes(server)


def test_the_default_and_unknown_indexes_cannot_be_deleted(server: ServerProcess, root: Path) -> None:
    default = _request(server, "DELETE", "/v1/indexes/a")
    assert default.status_code == 409 and default.json()["error"] == "index_protected", default.text
    assert "default" in default.json()["message"] and (root / "indexes" / "a" / "manifest.json").is_file()
    unknown = _request(server, "DELETE", "/v1/indexes/nope")
    assert unknown.status_code == 404 and unknown.json()["error"] == "not_found"


def test_a_created_index_starts_empty_takes_writes_and_is_searched(server: ServerProcess, root: Path) -> None:
    with Client(server.base_url, api_key=KEY, timeout=HTTP_TIMEOUT_S) as espn:
        info = espn.create_index("made", "small")
        assert (info.name, info.documents, info.default) == ("made", 0, False)
        assert info.encoder == _indexes(server)["a"]["encoder"]
        with pytest.raises(ConflictError):
            espn.create_index("made", "small")
        with pytest.raises(InvalidRequestError, match="small"):
            espn.create_index("other", "nope")
    assert (root / "indexes" / "made" / "manifest.json").is_file()
    assert [name for name in _listing(root) if name.startswith(".")] == [".deleted-mine"]  # its staging is gone
    assert _ids(_request(server, "POST", "/v1/indexes/made/search", QUERY)) == []  # the sample's documents are gone
    assert _request(server, "GET", "/v1/indexes/made/documents/s0001").status_code == 404
    written = _request(server, "POST", "/v1/indexes/made/documents/batch", {"upsert": DOCS})
    assert written.status_code == 200, written.text
    assert _ids(_request(server, "POST", "/v1/indexes/made/search", QUERY))[0] == "n1"
    assert set(_ids(_request(server, "POST", "/v1/indexes/made/search", {**QUERY, "k": 10}))) == {"n1", "n2", "n3"}
    assert "n1" not in _ids(_request(server, "POST", "/v1/indexes/b/search", QUERY))
    assert _indexes(server)["made"]["documents"] == 3


def test_the_memory_budget_closes_the_least_recently_used_idle_index(server: ServerProcess) -> None:
    listed = _indexes(server)
    assert all(item["memory_mib"] > 0 for item in listed.values())
    _ids(_request(server, "POST", "/v1/indexes/b/search", QUERY))
    _ids(_request(server, "POST", "/v1/indexes/made/search", QUERY))
    _ids(_request(server, "POST", "/v1/indexes/c/search", QUERY))  # b is the least recently used: closed for c
    listed = _indexes(server)
    assert listed["c"]["open"] and not listed["b"]["open"] and listed["made"]["open"] and listed["a"]["open"]
    _ids(_request(server, "POST", "/v1/indexes/b/search", QUERY))
    listed = _indexes(server)
    assert listed["b"]["open"] and not listed["c"]["open"] and listed["a"]["open"]
    assert "memory budget" in server.log()
    metrics = HTTP.get(server.base_url + "/metrics").text
    assert 'espn_index_memory_bytes{index="made"}' in metrics


def test_two_workers_keep_see_and_delete_created_indexes(server: ServerProcess, root: Path,
                                                         sample_index: Path) -> None:
    server.terminate()
    with _serve(root, "admin-workers", "--workers", "2") as again:
        # Each request lands on either worker: every answer must agree.
        for _ in range(4):
            assert _ids(_request(again, "POST", "/v1/indexes/made/search", QUERY))[0] == "n1"  # kept by the restart
        shutil.copytree(sample_index, root / "indexes" / ".tmp-copy")  # as another worker's creation: one rename
        (root / "indexes" / ".tmp-copy").rename(root / "indexes" / "copied")
        for _ in range(4):
            assert _request(again, "GET", "/v1/indexes/copied").status_code == 200
        with Client(again.base_url, api_key=KEY, timeout=HTTP_TIMEOUT_S) as espn:
            espn.delete_index("made")
            with pytest.raises(NotFoundError):
                espn.delete_index("made")
        assert not (root / "indexes" / "made").exists()
        assert [name for name in _listing(root) if name.startswith(".")] == [".deleted-mine"]
        for _ in range(4):
            response = _request(again, "POST", "/v1/indexes/made/search", QUERY)
            assert response.status_code == 404 and response.json()["error"] == "not_found", response.text
            assert "made" not in _indexes(again)
        assert json.loads((root / "indexes" / "copied" / "manifest.json").read_text())["counts"]["documents"] == 300
