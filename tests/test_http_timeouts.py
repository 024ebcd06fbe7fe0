"""Every HTTP client the tests make waits long enough for a loaded 2-core machine.

A whole suite runs on xdist workers beside other jobs; there a first search of a `--no-warmup`
server (which loads its model then) took longer than httpx's default 5 s. So, read from the
tests' source with `ast`: every `httpx.Client`/`httpx.AsyncClient` (but one on an in-process
transport) and every typed `espn_client` client names its timeout, every request of the shared
`HTTP` client (whose own timeout is `HTTP_TIMEOUT_S`) or of `httpx.get`/`post`/... waits at
least that long, and a literal timeout is never below `HTTP_TIMEOUT_S`. A call whose options
come as `**kwargs` is judged where they are written; a timeout that is short because a timeout
is what the test tests says so on its line (`# short on purpose`). Each violation is named as
`path:line`.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

from helpers import HTTP_TIMEOUT_S

TESTS = Path(__file__).resolve().parent
#: httpx's module-level request functions.
HTTPX_FUNCTIONS = {"get", "post", "put", "patch", "delete", "request", "stream", "head", "options"}
#: The typed client's classes and the retrievers that make one (each takes `timeout`).
TYPED_CLIENTS = {"Client", "AsyncClient"}


def _keyword(call: ast.Call, name: str) -> Optional[ast.expr]:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _short(value: Optional[ast.expr]) -> bool:
    """A literal number of seconds below HTTP_TIMEOUT_S (a name or an expression is a choice made elsewhere)."""
    return isinstance(value, ast.Constant) and isinstance(value.value, (int, float)) and value.value < HTTP_TIMEOUT_S


def _kind(call: ast.Call) -> Optional[str]:
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        if func.value.id == "httpx" and func.attr in ("Client", "AsyncClient"):
            return "client"
        if func.value.id == "httpx" and func.attr in HTTPX_FUNCTIONS:
            return "request"
        if func.value.id == "HTTP" and func.attr in HTTPX_FUNCTIONS:
            return "shared"
    if isinstance(func, ast.Name) and func.id in TYPED_CLIENTS:
        return "typed"
    return None


def violations(source: str, name: str) -> list[str]:
    """`name:line: what` for each HTTP client of `source` that a loaded machine can time out."""
    found = []
    lines = source.splitlines()
    for call in (node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)):
        kind, timeout, where = _kind(call), _keyword(call, "timeout"), f"{name}:{call.lineno}"
        given_http = _keyword(call, "transport") is not None or _keyword(call, "http_client") is not None
        given_elsewhere = any(keyword.arg is None for keyword in call.keywords)  # **options
        if kind is None or given_elsewhere or "# short on purpose" in lines[call.lineno - 1]:
            continue
        if kind in ("client", "typed") and timeout is None and not given_http:
            found.append(f"{where}: a client with no timeout (use HTTP_TIMEOUT_S from helpers)")
        elif kind == "request" and timeout is None:
            found.append(f"{where}: a request with httpx's default timeout (5 s)")
        elif _short(timeout):
            found.append(f"{where}: timeout {ast.literal_eval(timeout)} s, under HTTP_TIMEOUT_S ({HTTP_TIMEOUT_S} s)")
    return found


def test_every_http_client_of_the_tests_waits_long_enough() -> None:
    found = [line for path in sorted([*TESTS.glob("*.py"), *TESTS.glob("fakes/*.py")])
             for line in violations(path.read_text(encoding="utf-8"), str(path.relative_to(TESTS.parent)))]
    assert not found, f"{len(found)} HTTP client(s) that a loaded machine can time out:\n  " + "\n  ".join(found)


def test_the_scan_finds_what_it_looks_for() -> None:
    source = ("httpx.Client()\nhttpx.get(url)\nHTTP.get(url, timeout=2)\nClient(url)\nAsyncClient(url, timeout=5.0)\n"
              "httpx.Client(timeout=HTTP_TIMEOUT_S)\nhttpx.Client(transport=t)\nHTTP.get(url)\n"
              "Client(url, http_client=h)\nHTTP.post(url, timeout=120)\nClient(url, **options)\n"
              "Client(url, timeout=0.5)  # short on purpose: a stall is tested\n")
    assert [line.split(":")[1] for line in violations(source, "t.py")] == ["1", "2", "3", "4", "5"]
