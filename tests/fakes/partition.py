"""A partition's server for router tests: a real HTTP server on a free loopback port, in a
thread of the test process, that answers `espn route`'s calls (search, batch search, document
reads, writes, /readyz) as `espn serve` does, or in a chosen bad way (`FakePartition.mode`).

Only the standard library: no FastAPI here, so a bad answer is exactly the bytes written
(NaN, a truncated body, a wrong Content-Encoding, a stream with no end).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import unquote

from espn.partitioning import HASH_NAME

__all__ = ["FakePartition", "BAD_MODES", "HUGE_BYTES"]

HUGE_BYTES = 1 << 30  # what the `huge` mode streams, unless the reader stops first

# Every way a partition (or a proxy in front of it) answers badly, for every kind of call:
# each one's answer is what the router must not relay as a success.
BAD_MODES = (
    "html",          # 200 text/html (a proxy's page)
    "no_lists",      # 200 {"generation": 7}: no write lists, no search results
    "created_int",   # 200 {"generation": 7, "created": 5, ...}
    "wrong_types",   # 200 with strings where numbers go and numbers where ids go
    "other_ids",     # 200 a well-formed write result of other ids (and, to a search, not a search answer)
    "accepted",      # 202 {"status": "queued"}: a success status that is no write result
    "nan",           # NaN scores (and a NaN generation)
    "infinity",      # Infinity scores
    "overflow",      # 1e400: JSON that no float holds
    "huge_score",    # 1e39: finite, beyond float32
    "wrong_shape",   # a list for an object; a batch with one answer short
    "too_many",      # more hits than k
    "status_500",    # 500 with an HTML body
    "gzip_garbage",  # Content-Encoding: gzip over bytes that are not
    "deep",          # JSON nested 100,000 levels
    "truncated",     # a JSON body cut off in the middle
    "huge",          # 200 chunked, 1 GiB of JSON-looking bytes
    "huge_declared",  # Content-Length: 1 GiB declared, a stream behind it
)


def _hit(doc_id: str, score: Any) -> dict[str, Any]:
    return {"id": doc_id, "score": score, "cls_score": score, "bow_score": score, "title": None, "text": None}


def _stats() -> dict[str, Any]:
    return {"stage_ms": {"ann": 1.0, "total": 2.0}, "queue_ms": 0.5, "batch_size": 1, "hit_rate": 1.0,
            "bytes_read": 4096, "ios": 1, "prefetched": 3, "missed": 0}


class FakePartition:
    """Partition `index` of `count`: search hits `hits` (id -> score), documents in `docs`,
    writes applied to `docs` only in mode "good" (what it applied is in `applied`)."""

    def __init__(self, index: int, count: int, hits: dict[str, float]) -> None:
        self.index, self.count, self.hits = index, count, hits
        self.mode = "good"
        self.readyz: Optional[bytes] = None  # a body for /readyz instead of the right one
        self.docs: dict[str, dict[str, Any]] = {}
        self.generation = 0
        self.applied: list[tuple[str, str]] = []  # (method, id) of every write applied
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request
        self.streamed = 0  # bytes of the last huge answer that got out before the reader hung up
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"fake-partition-{index}", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        self.mode, self.readyz = "good", None

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- the right answers, as `espn serve` gives them -------------------------------------

    def readiness(self) -> dict[str, Any]:
        return {"status": "ready", "generation": self.generation, "mode": "read-write",
                "partition": {"index": self.index, "count": self.count, "by": HASH_NAME}}

    def search(self, query: str, k: int, score: Any = None) -> dict[str, Any]:
        ranked = sorted(self.hits.items(), key=lambda item: -item[1])[:k]
        return {"query": query, "results": [_hit(i, s if score is None else score) for i, s in ranked],
                "stats": _stats()}

    def write(self, method: str, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        with self.lock:
            created: list[str] = []
            replaced: list[str] = []
            deleted: list[str] = []
            if path == "/v1/documents/batch":
                upserts, deletes = body.get("upsert", []), body.get("delete", [])
            else:
                doc_id = unquote(path.split("/v1/documents/", 1)[1])
                upserts = [{"id": doc_id, **body}] if method == "PUT" else []
                deletes = [doc_id] if method == "DELETE" else []
            missing = [i for i in deletes if i not in self.docs]
            if missing:
                return 404, {"error": "document_not_found", "message": f"no document with id {missing[0]!r}"}
            self.generation += 1
            for document in upserts:
                (replaced if document["id"] in self.docs else created).append(document["id"])
                self.docs[document["id"]] = document
                self.applied.append(("upsert", document["id"]))
            for doc_id in deletes:
                del self.docs[doc_id]
                deleted.append(doc_id)
                self.applied.append(("delete", doc_id))
            status = 201 if method == "PUT" and created else 200
            return status, {"generation": self.generation, "created": created, "replaced": replaced,
                            "deleted": deleted}


def _handler(partition: FakePartition) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _send(self, status: int, body: bytes, content_type: str = "application/json",
                  headers: Optional[dict[str, str]] = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, body: Any) -> None:
            self._send(status, json.dumps(body).encode())

        def _stream(self, declared: bool) -> None:
            """1 GiB of `{"results": [` and spaces, until the reader hangs up."""
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if declared:
                self.send_header("Content-Length", str(HUGE_BYTES))
            else:
                self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b'{"results": [' + b" " * ((1 << 20) - 13)
            sent = 0
            try:
                while sent < HUGE_BYTES:
                    if declared:
                        self.wfile.write(chunk)
                    else:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    sent += len(chunk)
                if not declared:
                    self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                partition.streamed = sent
                self.close_connection = True

        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            return json.loads(raw) if raw else {}

        def _answer(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            partition.requests.append((method, path))
            body = self._body()
            if path == "/readyz":
                if partition.readyz is not None:
                    return self._send(200, partition.readyz)
                return self._json(200, partition.readiness())
            mode = partition.mode
            if mode != "good":
                return self._bad(mode, method, path, body)
            if path == "/v1/search":
                return self._json(200, partition.search(body["query"], body.get("k", 10)))
            if path == "/v1/search/batch":
                responses = [{**partition.search(q, body.get("k", 10)), "index": i}
                             for i, q in enumerate(body["queries"])]
                return self._json(200, {"responses": responses, "errors": []})
            if method == "GET" and path.startswith("/v1/documents/"):
                doc_id = unquote(path.split("/v1/documents/", 1)[1])
                document = partition.docs.get(doc_id)
                if document is None:
                    return self._json(404, {"error": "document_not_found", "message": f"no document {doc_id!r}"})
                return self._json(200, {"id": doc_id, "title": document.get("title", ""),
                                        "text": document["text"], "metadata": {}})
            status, answer = partition.write(method, path, body)
            return self._json(status, answer)

        def _bad(self, mode: str, method: str, path: str, body: Any) -> None:
            asked = body.get("upsert", [{}])[0].get("id", "x") if isinstance(body, dict) and body.get("upsert") else "x"
            search = partition.search(body.get("query", "q"), body.get("k", 10)) if isinstance(body, dict) else {}
            if mode == "html":
                return self._send(200, b"<html><body>OK</body></html>", "text/html")
            if mode == "no_lists":
                return self._json(200, {"generation": 7})
            if mode == "created_int":
                return self._json(200, {"generation": 7, "created": 5, "replaced": [], "deleted": []})
            if mode == "wrong_types":
                return self._json(200, {"generation": "7", "created": [1], "replaced": [], "deleted": [],
                                        "query": 5, "results": [{"id": 1, "score": "high"}], "stats": []})
            if mode == "other_ids":
                return self._json(200, {"generation": 7, "created": [asked + "-other"], "replaced": [],
                                        "deleted": []})
            if mode == "accepted":
                return self._json(202, {"status": "queued"})
            if mode in ("nan", "infinity", "overflow", "huge_score"):
                literal = {"nan": "NaN", "infinity": "Infinity", "overflow": "1e400", "huge_score": "1e39"}[mode]
                if path == "/v1/search/batch":
                    text = json.dumps({"responses": [{**partition.search(q, body.get("k", 10), "SCORE"), "index": i}
                                                     for i, q in enumerate(body["queries"])]})
                elif path == "/v1/search":
                    text = json.dumps(partition.search(body["query"], body.get("k", 10), "SCORE"))
                elif method == "GET":
                    text = json.dumps({"id": "SCORE", "title": "", "text": "t", "metadata": {}})
                else:
                    text = json.dumps({"generation": "SCORE", "created": [asked], "replaced": [], "deleted": []})
                return self._send(200, text.replace('"SCORE"', literal).encode())
            if mode == "wrong_shape":
                if path == "/v1/search/batch":  # one answer short
                    responses = [{**partition.search(q, body.get("k", 10)), "index": i}
                                 for i, q in enumerate(body["queries"][1:], start=1)]
                    return self._json(200, {"responses": responses, "errors": []})
                return self._json(200, [search, 1, 2])
            if mode == "too_many":
                many = {**search, "results": [_hit(f"extra-{i}", 0.1) for i in range(body.get("k", 10) + 5)]}
                if path == "/v1/search/batch":
                    return self._json(200, {"responses": [{**many, "index": i} for i in range(len(body["queries"]))]})
                return self._json(200, many)
            if mode == "status_500":
                return self._send(500, b"<html>Internal Server Error</html>", "text/html")
            if mode == "gzip_garbage":
                return self._send(200, b"this is not gzip at all" * 10, headers={"Content-Encoding": "gzip"})
            if mode == "deep":
                return self._send(200, b"[" * 100_000 + b"]" * 100_000)
            if mode == "truncated":
                return self._send(200, json.dumps(search).encode()[:-7])
            if mode == "path_404":  # no such path: a wrong URL prefix, a proxy's page
                return self._json(404, {"detail": "Not Found"})
            if mode in ("huge", "huge_declared"):
                return self._stream(declared=mode == "huge_declared")
            raise AssertionError(f"unknown mode {mode!r}")

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def do_PUT(self) -> None:
            self._answer("PUT")

        def do_DELETE(self) -> None:
            self._answer("DELETE")

    return Handler
